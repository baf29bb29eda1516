"""Which failures end one request and which end the engine: decided here, once.

Three kinds of error (docs/shared style, habit 8):

- bad input the front end can see is refused there with HTTP 400 (`AotPlatform.validate_request`
  and vLLM's own validation, which checks logprobs against the `max_logprobs` the platform
  caps at what the head programs compute);
- a broken invariant is an `assert` with a message: fatal;
- a runtime failure while the runner serves a step is classified by `is_per_request`: a
  `RequestError` (a request the front end let through that the compiled model cannot serve),
  or any other `Exception` raised while the runner worked for one request only (a new request's
  admission, a step of one request, one row's host-side logits processing), ends that request
  alone. Anything else propagates: vLLM's engine core logs it and shuts down, its front end
  answers 500 and exits, and `vllm-aot serve` restarts the replica. On several
  tensor-parallel ranks only a `RequestError` (which every rank finds alike) ends one request:
  any other failure may have struck one rank alone, whose collectives would then no longer
  meet the others' (a lost rank is one): fatal.

A request that failed is forgotten by the runner at once and reported in its output
(`AotRunnerOutput.failed_requests`); `AotScheduler.update_from_output` finishes it with vLLM's
`FINISHED_ERROR`, which the front end turns into HTTP 500 (an SSE error event when streaming),
and the engine goes on serving everyone else.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from vllm.v1.outputs import ModelRunnerOutput

from vllm_aot.kernels import collectives


class RequestError(ValueError):
    """One request that the compiled model cannot serve, found in the engine; it alone fails."""


def is_per_request(exc: BaseException, num_requests: int) -> bool:
    """Whether `exc`, raised while the runner worked for `num_requests` requests, ends only them.

    A broken invariant (AssertionError) means the runner's own state cannot be trusted, and a
    MemoryError or a BaseException (KeyboardInterrupt, SystemExit) concerns the process: those
    are fatal. A failure shared by several requests (a batch's layer or head program) cannot be
    blamed on one of them: fatal too.
    """
    if isinstance(exc, RequestError):
        return True
    if isinstance(exc, (AssertionError, MemoryError)) or not isinstance(exc, Exception):
        return False
    if collectives.is_installed():  # one of several ranks: see the module docstring
        return False
    return num_requests == 1


def describe(exc: BaseException) -> str:
    """The reason logged for a failed request."""
    return str(exc) if isinstance(exc, RequestError) else f"{type(exc).__name__}: {exc}"


@dataclass
class AotRunnerOutput(ModelRunnerOutput):
    """vLLM's runner output plus the requests that failed in this step (they get no tokens).

    The scheduler receives this object as it is: in process (`uni`), or pickled by vLLM's
    multiprocessing executor (several ranks).
    """

    failed_requests: dict[str, str] = field(default_factory=dict)  # req_id -> reason


def failed_requests(output: ModelRunnerOutput) -> Mapping[str, str]:
    """The requests a runner output reports as failed (none for vLLM's own empty output)."""
    return output.failed_requests if isinstance(output, AotRunnerOutput) else {}
