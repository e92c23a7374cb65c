"""Named benchmark suites: a campaign's stages in priority order, each in its own process.

    python -m benchmarks.run --suite h200-core [--stages NAME ...] [--time-budget SECONDS]
        [--out benchmarks/results] [--logs DIR] [--copy-to DIR] [any benchmarks.run shape flag ...]

Without ``--time-budget`` every stage runs its whole sweep. With one, the seconds left are shared
among the stages still to run in proportion to their ``share`` (so time a stage leaves unused goes to
the later ones, and when time runs short the lowest priorities go first); a stage whose share is
under ``MIN_STAGE_S`` is skipped, and each process is interrupted ``GRACE_S`` after its budget.
Flags the suite does not know (``--preset tiny --scale 0.02 ...``) go to every workload and bucket
sweep stage. Logs go to ``--logs`` (default ``<out>/logs``, not part of the results);
``--copy-to`` receives the results (a tar.gz, REPORT.md, the headline JSONs, the suite log) after
every stage, so a run cut short still hands back what it finished.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
from typing import Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # stages run from the repository root
MIN_STAGE_S = 30.0  # a workload process needs about this much for start-up and one configuration
GRACE_S = 40.0  # after its budget a process may still be saving its last record
PY = sys.executable


@dataclasses.dataclass(frozen=True)
class Stage:
    """One process of a suite: ``argv`` after ``python``; ``share`` weighs it in a time budget."""

    name: str
    argv: tuple[str, ...]
    share: float
    takes_budget: bool = False  # passes its budget as --time-budget (else only the process limit)
    workload_shares: tuple[tuple[str, float], ...] = ()  # -> --workload-budget NAME=SECONDS
    shape_flags: bool = False  # gets the flags the suite does not know (shapes, preset)
    env: tuple[tuple[str, str], ...] = ()
    log: Optional[str] = None  # its own log file in the logs folder (else the suite log)
    default: bool = True


def _run(*args: str) -> tuple[str, ...]:
    return ("-m", "benchmarks.run", "--no-plot", *args)


_GPU_ENV = (("JAX_PLATFORMS", ""), ("XLA_FLAGS", ""))  # the tests' conftest would force the CPU

SUITES: dict[str, tuple[Stage, ...]] = {
    # The H200 campaign of benchmarks/README.md: correctness first, then the targets' workloads.
    "h200-core": (
        Stage(
            "gpu-tests",
            ("-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:warnings", "--tb=short", "-m", "gpu", "tests/"),
            share=150,
            env=_GPU_ENV,
            log="gpu_tests.txt",
        ),
        Stage(
            "attention",
            ("benchmarks/attention_sweep.py", "--out", "{out}", "--no-copy"),
            share=230,
            env=_GPU_ENV,
            log="attention_sweep.txt",
            default=False,
        ),
        Stage(
            "serve1k+long4",
            _run("--workload", "serve1k", "long4", "--concurrency", "1", "128", "32", "--exit", "fixed", "early"),
            share=225,
            takes_budget=True,
            workload_shares=(("serve1k", 130), ("long4", 95)),
            shape_flags=True,
        ),
        Stage(
            "mixed32+decode_under_prefill",
            _run("--workload", "mixed32", "decode_under_prefill"),
            share=85,
            takes_budget=True,
            workload_shares=(("mixed32", 45), ("decode_under_prefill", 40)),
            shape_flags=True,
        ),
        Stage(
            "generate",
            _run(
                "--workload",
                "long4",
                "serve1k",
                "--generate-only",
                "--append",
                "--concurrency",
                "1",
                "128",
                "32",
                "--generate-concurrency",
                "1",
                "32",
                "128",
            ),  # fmt: skip
            share=80,
            takes_budget=True,
            shape_flags=True,
        ),
        Stage(
            "sweep",
            ("-m", "benchmarks.sweep_buckets", "--part", "device", "--reps", "10", "--no-plot"),
            share=30,
            shape_flags=True,
        ),
        Stage("profile", ("-m", "benchmarks.profile_step"), share=120, default=False),
        # issue 13's decode sweep (~8 min on its own): `--stages decode report`
        Stage(
            "decode",
            ("-m", "benchmarks.decode", "--no-plot"),
            share=240,
            takes_budget=True,
            shape_flags=True,
            default=False,
        ),
        Stage("mixed128", _run("--workload", "mixed128"), share=200, takes_budget=True, shape_flags=True),
        Stage("report", ("-m", "benchmarks.report"), share=25),
    ),
}
# Beside the GPU stages when "sweep" runs: the padding analysis needs the scheduler alone.
PADDING_SHARE_OF_TOTAL = 0.4


class Suite:
    def __init__(self, name: str, stages: Sequence[str], out: str, logs: str, budget: Optional[float], extra, copy_to):
        known = {s.name: s for s in SUITES[name]}
        bad = [s for s in stages if s not in known]
        if bad:
            raise ValueError(f"suite {name} has no stage {', '.join(bad)}; its stages: {', '.join(known)}")
        if budget is not None and budget <= 0:
            raise ValueError(f"--time-budget must be positive, got {budget}")
        self.stages = [s for s in SUITES[name] if s.name in stages]
        out, logs = os.path.abspath(out), os.path.abspath(logs)
        copy_to = copy_to and os.path.abspath(copy_to)
        self.name, self.out, self.logs, self.budget, self.extra, self.copy_to = name, out, logs, budget, extra, copy_to
        self.start = time.monotonic()
        os.makedirs(out, exist_ok=True)
        os.makedirs(logs, exist_ok=True)
        self.log_path = os.path.join(logs, "suite_log.txt")
        open(self.log_path, "w").close()

    def left(self) -> float:
        return float("inf") if self.budget is None else self.budget - (time.monotonic() - self.start)

    def say(self, msg: str) -> None:
        line = f"[{time.monotonic() - self.start:.0f}s] {msg}"
        print(line, flush=True)
        with open(self.log_path, "a") as f:
            f.write(line + "\n")

    def argv(self, stage: Stage, budget: Optional[float]) -> list[str]:
        a = [x.format(out=self.out) for x in stage.argv]
        if stage.name == "report":
            a += ["--results", self.out]
        elif stage.name == "profile":
            a += ["--out", os.path.join(self.out, "profile_step.json")]
        elif stage.name == "sweep":
            a += ["--out", self.out, "--merge", os.path.join(self.out, "bucket_padding.json")]
        elif stage.argv[:2] in (("-m", "benchmarks.run"), ("-m", "benchmarks.decode")):
            a += ["--out", self.out]
        if budget is not None and stage.takes_budget:
            a += ["--time-budget", f"{budget:.0f}"]
            if stage.workload_shares:
                total = sum(s for _, s in stage.workload_shares)
                a += ["--workload-budget"] + [f"{w}={budget * s / total:.0f}" for w, s in stage.workload_shares]
        if stage.shape_flags:
            a += self.extra
        return a

    def spawn(self, stage: Stage, argv: list[str], log_file: str) -> subprocess.Popen:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")  # the KV pool of serve1k c=128 needs it
        env.update(dict(stage.env))
        with open(log_file, "a") as f:
            return subprocess.Popen([PY, *argv], stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)

    @staticmethod
    def wait(p: subprocess.Popen, limit: Optional[float]) -> int:
        """The exit status; past ``limit`` seconds SIGINT (records so far are saved), then kill."""
        try:
            return p.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGINT)
            try:
                return p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                return p.wait()

    def run_stage(self, stage: Stage, i: int) -> None:
        budget = None
        if self.budget is not None:
            shares = sum(s.share for s in self.stages[i:])
            budget = self.left() * stage.share / shares
            if stage.name == "report":  # cheap, and what the others were for
                budget = max(budget, MIN_STAGE_S)
            elif budget < MIN_STAGE_S:
                self.say(f"skip {stage.name}: {self.left():.0f} s left")
                return
        argv = self.argv(stage, budget)
        log_file = os.path.join(self.logs, stage.log) if stage.log else self.log_path
        self.say(f"start {stage.name}" + (f" (budget {budget:.0f} s)" if budget else "") + ": " + " ".join(argv))
        limit = None
        if budget is not None:
            limit = budget if not stage.takes_budget else budget + GRACE_S
        rc = self.wait(self.spawn(stage, argv, log_file), limit)
        self.say(f"end {stage.name} (rc {rc})")
        self.snapshot()

    def padding(self) -> Optional[threading.Thread]:
        """The padding analysis of every workload, on the CPU beside the GPU stages."""
        if not any(s.name == "sweep" for s in self.stages):
            return None
        argv = ["-m", "benchmarks.sweep_buckets", "--part", "padding", "--no-plot", "--no-progress"]
        argv += ["--json", os.path.join(self.out, "bucket_padding.json"), *self.extra]
        limit = None
        if self.budget is not None:
            argv += ["--time-budget", f"{self.budget * PADDING_SHARE_OF_TOTAL:.0f}"]
            limit = self.budget * PADDING_SHARE_OF_TOTAL + GRACE_S
        stage = Stage("padding", tuple(argv), 0, env=(("JAX_PLATFORMS", "cpu"),))
        p = self.spawn(stage, argv, os.path.join(self.logs, "bucket_padding.txt"))
        t = threading.Thread(target=lambda: self.say(f"padding analysis done (rc {self.wait(p, limit)})"))
        t.start()
        return t

    def snapshot(self) -> None:
        if not self.copy_to:
            return
        os.makedirs(self.copy_to, exist_ok=True)
        tmp = os.path.join(self.copy_to, "results.tar.gz.tmp")
        with tarfile.open(tmp, "w:gz") as tar:
            tar.add(self.out, arcname=os.path.basename(os.path.normpath(self.out)))
        os.replace(tmp, os.path.join(self.copy_to, "results.tar.gz"))
        for f in ("REPORT.md", "serve1k.json", "long4.json", "decode.json", "bucket_sweep.json"):
            if os.path.isfile(os.path.join(self.out, f)):
                shutil.copy(os.path.join(self.out, f), self.copy_to)
        shutil.copy(self.log_path, self.copy_to)

    def run(self) -> None:
        cap = "no time budget" if self.budget is None else f"{self.budget:.0f} s"
        self.say(f"suite {self.name}: {cap}; stages {' '.join(s.name for s in self.stages)}")
        if shutil.which("nvidia-smi"):
            q = "--query-gpu=name,memory.total,memory.used,clocks.sm,clocks.mem"
            info = subprocess.run(["nvidia-smi", q, "--format=csv"], capture_output=True, text=True)
            self.say(info.stdout.strip())
        pad = self.padding()
        report = [s for s in self.stages if s.name == "report"]
        for i, stage in enumerate(self.stages):
            if stage.name != "report":
                self.run_stage(stage, i)
        if pad is not None:
            pad.join()
            if os.path.isfile(os.path.join(self.out, "bucket_sweep.json")):  # fold a late padding part in
                argv = ["-m", "benchmarks.sweep_buckets", "--part", "--no-plot", "--out", self.out]
                argv += ["--merge", os.path.join(self.out, "bucket_padding.json")]
                self.wait(self.spawn(Stage("fold", ()), argv, self.log_path), None)
        for stage in report:
            self.run_stage(stage, len(self.stages) - 1)
        self.say("done")
        self.snapshot()


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.run --suite",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--suite", required=True, choices=sorted(SUITES))
    ap.add_argument("--stages", nargs="+", default=None, help="default: the suite's default stages")
    ap.add_argument("--time-budget", type=float, default=None, help="seconds for the whole suite (default: none)")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--logs", default=None, help="default: <out>/logs")
    ap.add_argument("--copy-to", default=None, help="refresh a copy of the results here after every stage")
    return ap


def main(argv: Sequence[str]) -> None:
    a, extra = parser().parse_known_args(list(argv))
    stages = a.stages or [s.name for s in SUITES[a.suite] if s.default]
    try:
        suite = Suite(a.suite, stages, a.out, a.logs or os.path.join(a.out, "logs"), a.time_budget, extra, a.copy_to)
    except ValueError as e:
        raise SystemExit(f"benchmarks suite: {e}") from None
    suite.run()
