"""Greedy generation through vLLM CPU: the fast engine of :func:`~kvshot_lib.corpus.regenerate_sharegpt`.

vLLM lives in its own environment, ``.venv-serve`` (``make interop-env``: it pins a transformers of its own), so
:class:`VllmGreedy` starts ``vllm_worker.py`` there once and sends it batches of token-id prompts over a pipe
(the protocol is in that file). It is a drop-in for :func:`~kvshot_lib.corpus.regenerate.batched_greedy`:
``engine(prompts, max_new_tokens)`` returns each prompt's greedy continuation, cut after its first stop token.
``KVSHOT_VLLM_THREADS`` gives the worker fewer threads than the machine's cores (two OpenMP pools that spin on
two shared cores slow each other many times over).

Measured on a 2-core Intel Xeon (AVX512-BF16, no AMX), first ShareGPT user turns, 128 new tokens: vLLM CPU in
bf16 at 245-283 tok/s against 64-90 for ``batched_greedy`` (the brief). :func:`serve_python` says whether the
environment is there; where it is not, regeneration keeps the suite's own engine.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from ..target import assets

WORKER = Path(__file__).with_name("vllm_worker.py")
SERVE_VENV = assets.REPO_ROOT / ".venv-serve"


class VllmUnavailable(RuntimeError):
    """vLLM CPU cannot serve this target here; the message says why and what to do."""


def serve_python(venv: Path = SERVE_VENV) -> Path | None:
    """The interpreter of the vLLM environment, or None where ``make interop-env`` has not made it."""
    py = Path(venv) / "bin" / "python"
    return py if py.is_file() else None


def model_folder(target) -> Path:
    """The Hugging Face folder vLLM loads for ``target``: the converted SmolLM2, or the target's own local folder."""
    if target.info.name == "smollm2-135m":
        return assets.smollm2_model_dir()
    if Path(target.info.name).expanduser().is_dir():
        return Path(target.info.name).expanduser()
    raise VllmUnavailable(
        f"vLLM needs a model folder on disk; target {target.info.name!r} has none (a random test model or a hub "
        "id): pass engine='suite', or a local folder as the target."
    )


class VllmGreedy:
    """``engine(prompts, max_new_tokens) -> continuations``, greedy, on vLLM CPU in ``dtype``; a context manager
    that stops the worker on exit."""

    def __init__(
        self,
        target,
        dtype: str = "bfloat16",
        max_model_len: int = 2048,
        venv: Path = SERVE_VENV,
        spec_model: Path | None = None,
        spec_k: int = 3,
    ):
        py = serve_python(venv)
        if py is None:
            raise VllmUnavailable(
                f"no vLLM environment at {venv}: run `make interop-env` (about 2 min) first."
            )
        self.stops = list(target.info.eos_token_ids)
        self.dtype = dtype
        cmd = [str(py), str(WORKER), str(model_folder(target)), "--dtype", dtype]
        cmd += ["--max-model-len", str(max_model_len)]
        if os.environ.get("KVSHOT_VLLM_THREADS"):  # fewer threads than cores: a CPU shared with other work
            cmd += ["--threads", os.environ["KVSHOT_VLLM_THREADS"]]
        if spec_model is not None:  # speculative decoding with an EAGLE-3 drafter folder
            cmd += ["--spec-model", str(spec_model), "--spec-k", str(spec_k)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        hello = self._read()
        self.version = hello.get("vllm", "?")
        self.seconds = 0.0  # generation time inside vLLM, summed
        self.last: dict = {}  # the last reply: per-prompt seconds, speculative counters

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            raise VllmUnavailable(f"the vLLM worker stopped (exit code {code}); its messages are above.")
        return json.loads(line)

    def __call__(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        one_at_a_time: bool = False,
        stop_at_loop: bool = False,
    ) -> list[list[int]]:
        """Greedy continuations; ``stop_at_loop`` ends an answer once it loops (``corpus.looping``), without a stop
        token, as if cut by ``max_new_tokens``."""
        req = dict(
            prompts=[list(map(int, p)) for p in prompts],
            max_new_tokens=max_new_tokens,
            stop_ids=self.stops,
            one_at_a_time=one_at_a_time,
            stop_at_loop=stop_at_loop,
        )
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.last = self._read()
        self.seconds += self.last["seconds"]
        return self.last["outputs"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def __enter__(self) -> VllmGreedy:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
