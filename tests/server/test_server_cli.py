"""``ouro-jax generate`` in-process and ``ouro-jax serve`` as a subprocess: a second start finds its
executable in the persistent cache, and SIGTERM lets a running stream finish before the process exits."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time

import httpx
import pytest

pytest.importorskip("fastapi")

from scheduler import SamplingParams  # noqa: E402
from tests.server.conftest import ENGINE, TEXT_PROMPT, ServeProcess, free_port, write_checkpoint  # noqa: E402

FLAGS = [
    "--max-num-seqs", str(ENGINE["max_num_seqs"]),
    "--max-num-batched-tokens", str(ENGINE["max_num_batched_tokens"]),
    "--prefill-chunk-size", str(ENGINE["prefill_chunk_size"]),
    "--block-size", str(ENGINE["block_size"]),
    "--max-model-len", str(ENGINE["max_model_len"]),
    "--buckets", ",".join(map(str, ENGINE["buckets"])),
    "--fused-decode-max-rows", str(ENGINE["fused_decode_max_rows"]),
]  # fmt: skip
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from ouro_jax.server.startup import build_engine

    folder = write_checkpoint(tmp_path_factory.mktemp("ckpt_cli"))
    llm, _ = build_engine(folder, ENGINE)  # fills the persistent cache for the starts below
    sp = SamplingParams(max_tokens=6, ignore_eos=True, exit_threshold=0.5)
    want = llm.generate([TEXT_PROMPT], sp, use_tqdm=False)[0]
    return folder, want


def test_generate_streams_text(ckpt, capsys):
    from ouro_jax.cli import main

    folder, want = ckpt
    argv = ["generate", folder, TEXT_PROMPT, "--max-tokens", "6", "--ignore-eos", "--exit-threshold", "0.5", *FLAGS]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert out == want.text + "\n"
    assert "6 tokens" in err and "finish_reason=length" in err


@pytest.mark.slow
def test_serve_subprocess_cached_start_and_sigterm_drain(ckpt):
    folder, _ = ckpt
    port = free_port()
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", JAX_DEFAULT_MATMUL_PRECISION="highest")
    cmd = [sys.executable, "-m", "ouro_jax.cli", "serve", folder, "--port", str(port), "--served-model-name", "m"]
    server = ServeProcess(cmd + FLAGS, env, port, timeout=180)
    proc, url = server.proc, server.url
    try:
        body = dict(model="m", prompt=[5, 6], max_tokens=40, temperature=0, stream=True, ignore_eos=True)
        ids, lines = [], []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if not line:
                    continue
                lines.append(line)
                if line.startswith("data: {"):
                    ids += json.loads(line[6:])["choices"][0]["token_ids"]
                    if len(ids) == 1:
                        proc.send_signal(signal.SIGTERM)  # mid-stream: this request must still finish
                        time.sleep(0.2)
                        try:  # new requests are refused (503, or the listening socket is already closed)
                            st = httpx.post(url + "/v1/completions", json=dict(body, stream=False), timeout=5)
                            assert st.status_code == 503
                        except httpx.TransportError:
                            pass
        assert lines[-1] == "data: [DONE]" and len(ids) == 40
        assert proc.wait(timeout=60) == 0
    finally:
        server.close()
    text = server.text
    # start-up is logged in parts, and the executable compiled in-process above came from the cache
    assert "start-up: loaded" in text and "start-up: ready in" in text, text
    # from the executable store, or from JAX's persistent cache where the store declined to save (on
    # the CPU only provably fresh compiles are saved): either way nothing compiled (the bucket and
    # its separate sampler)
    pattern = (
        r"2 executables in [\d.]+ s \((\d) from the executable store, (\d) from the persistent cache, 0 compiled\)"
    )
    m = re.search(pattern, text)
    assert m and int(m[1]) + int(m[2]) == 2, text


@pytest.mark.parametrize(
    "argv,msg",
    [
        (["generate", "tiny", "hello"], "no tokenizer"),
        (["generate", "tiny", "1 2", "--exit-threshold", "2"], "exit_threshold"),
        (["generate", "no-such-model", "1 2"], "preset"),
        (["serve", "tiny", "--port", "70000"], "port must lie in [0, 65535]"),
        (["serve", "tiny", "--max-num-seqs", "64", "--max-num-batched-tokens", "8"], "max_num_batched_tokens (8)"),
        (["demo", "--prefill-mode", "wavefront", "--kv-layout", "shared"], "kv_layout='last_exited'"),
    ],
)
def test_cli_rejects_bad_input_before_building(argv, msg, capsys):
    from ouro_jax.cli import main

    t = time.perf_counter()
    assert main(argv) == 1
    assert msg in capsys.readouterr().err
    assert time.perf_counter() - t < 5  # no engine was built


@pytest.mark.parametrize(
    "argv,msg",
    [
        (["serve", "tiny", "--buckets", "8,x"], "argument --buckets: expected comma separated integers"),
        (["serve", "tiny", "--prefill-mode", "chunked"], "argument --prefill-mode: invalid choice"),
        (["generate", "tiny", "1", "--max-num-seqz", "4"], "unrecognized arguments: --max-num-seqz"),
    ],
)
def test_cli_flags_are_parsed_as_the_fields_declare(argv, msg, capsys):
    """A flag's value is refused by the parser (a usage error, exit 2), naming the flag."""
    from ouro_jax.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert msg in capsys.readouterr().err


def test_engine_switches_reach_the_engine_only_when_given():
    import argparse

    from ouro_jax.engine_config import add_arguments, from_arguments
    from ouro_jax.server.cli_commands import ENGINE_SECTIONS

    p = argparse.ArgumentParser()
    add_arguments(p, ENGINE_SECTIONS)
    kw = lambda *argv: from_arguments(p.parse_args(list(argv)))  # noqa: E731
    assert kw() == {}  # left out: the LLM defaults
    assert kw("--no-async-scheduling", "--enable-prefix-caching") == dict(
        async_scheduling=False, enable_prefix_caching=True
    )
    assert kw("--async-scheduling", "--max-num-seqs", "4") == dict(async_scheduling=True, max_num_seqs=4)
