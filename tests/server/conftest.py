"""Shared by the server tests: a checkpoint folder of the ``tiny`` preset with a WordLevel
tokenizer and a chat template (``write_checkpoint``), and an ``ouro-jax serve`` subprocess
(``ServeProcess``: a free port, its output collected in a thread, a wait for ``/health`` that fails
with the server's log if it dies or never answers)."""

import json
import os
import socket
import subprocess
import threading
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    def __init__(self, cmd: list[str], env: dict, port: int, timeout: float):
        import httpx

        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.log: list[str] = []
        self.reader = threading.Thread(target=lambda: self.log.extend(self.proc.stdout), daemon=True)
        self.reader.start()
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, self.text
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not start:\n" + self.text
            time.sleep(0.2)

    @property
    def text(self) -> str:
        return "".join(self.log)

    def close(self) -> None:
        """Kill the process if it still runs, and wait for its output."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.reader.join(10)


SPECIAL = ["<|endoftext|>", "<s>", "<|im_start|>", "<|im_end|>", "<unk>"]
WORDS = [f"w{i}" for i in range(128 - len(SPECIAL) - 3)] + ["user", "assistant", "system"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ '<|im_start|>' + m['role'] + ' ' + m['content'] + ' <|im_end|> ' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant ' }}{% endif %}"
)
TEXT_PROMPT = "w1 w2 w3 w4 w5"
CHAT = [{"role": "system", "content": "w7 w8"}, {"role": "user", "content": "w9 w10 w11"}]
CHAT_TEXT = "<s><|im_start|>system w7 w8 <|im_end|> <|im_start|>user w9 w10 w11 <|im_end|> <|im_start|>assistant "


def write_checkpoint(folder) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers

    from weights import save_random

    save_random(folder, "tiny", seed=0, layout="hf", dtype="float32")
    vocab = {t: i for i, t in enumerate(SPECIAL + WORDS)}
    assert len(vocab) == 128  # the tiny preset's vocab_size
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIAL)
    tok.save(os.path.join(folder, "tokenizer.json"))
    cfg = dict(
        bos_token="<s>",
        eos_token={"content": "<|endoftext|>", "special": True},
        unk_token="<unk>",
        chat_template=CHAT_TEMPLATE,
    )
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f)
    return str(folder)


# the one-bucket engine of the HTTP tests (one compiled executable and its sampler)
ENGINE = dict(
    max_num_seqs=8,
    max_num_batched_tokens=16,
    prefill_chunk_size=8,
    block_size=4,
    max_model_len=64,
    buckets=[16],
    fused_decode_max_rows=0,
)
# the data-parallel tests' engine (prefix caching on: prefix-aware routing)
DP_ENGINE = dict(
    max_num_seqs=4,
    max_num_batched_tokens=16,
    prefill_chunk_size=8,
    block_size=4,
    max_model_len=64,
    buckets=[16],
    fused_decode_max_rows=0,
    enable_prefix_caching=True,
)
