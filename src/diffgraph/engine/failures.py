"""The engine's failure policy: when a failing engine stops being "ready".

A failed step fails only that step's requests. `max_step_failures` consecutive failed steps, or one error of the kinds
that leave a CUDA context unusable (an illegal address, an ECC fault, a device-side assert: every later call fails too)
in a step or a decode, mark the engine failed, with the reason: its `ready` turns False (the server's /ready answers 503
with the reason, the router stops choosing it, Ray's health check fails it, a replica process exits and is restarted
with backoff), every request it still holds ends with EngineClosed (503, retryable elsewhere), and the next submit
raises EngineClosed naming the reason. A successful step resets the count.
"""

from __future__ import annotations

from dataclasses import dataclass

# messages of the CUDA errors after which a context is unusable (torch raises them as RuntimeError/AcceleratorError)
POISONING = ("illegal memory access", "illegal instruction", "misaligned address", "uncorrectable ecc",
             "ecc error", "device-side assert", "unspecified launch failure", "launch timed out",
             "cudaerrorlaunchfailure", "cuda error: unknown error")


def poisons_the_device(error: BaseException) -> bool:
    """Whether `error` is one after which the device's context is unusable."""
    text = f"{type(error).__name__}: {error}".lower()
    return any(p in text for p in POISONING)


@dataclass
class FailurePolicy:
    max_step_failures: int = 3
    streak: int = 0            # consecutive failed steps (a successful step sets it to 0)
    reason: str | None = None  # why the engine is failed; None while it serves

    def __post_init__(self) -> None:
        if isinstance(self.max_step_failures, bool) or not isinstance(self.max_step_failures, int) \
                or self.max_step_failures < 1:
            raise ValueError(f"max_step_failures must be an integer >= 1, got {self.max_step_failures!r}")

    def step_failed(self, error: BaseException) -> bool:
        """Counts a failed step; True when it marks the engine failed (once)."""
        self.streak += 1
        if self.reason is not None:
            return False
        if poisons_the_device(error):
            self.reason = f"a step failed with an error that leaves the device unusable ({type(error).__name__}: " \
                          f"{error}); the engine must be restarted"
        elif self.streak >= self.max_step_failures:
            self.reason = f"{self.streak} consecutive steps failed (the last: {type(error).__name__}: {error})"
        return self.reason is not None

    def decode_failed(self, error: BaseException) -> bool:
        """A decode (or the copy of finished rows before it) failed: only an error that leaves the device unusable
        marks the engine failed (True, once); any other fails that decode's requests alone and counts nothing."""
        if self.reason is not None or not poisons_the_device(error):
            return False
        self.reason = f"a decode failed with an error that leaves the device unusable ({type(error).__name__}: " \
                      f"{error}); the engine must be restarted"
        return True

    def loop_failed(self, error: BaseException) -> bool:
        """A bug in the engine loop itself (it stopped): the engine is failed, as a tripped policy; True the first
        time (a replica process then exits to be restarted, instead of staying up with a dead loop)."""
        if self.reason is not None:
            return False
        self.reason = f"its loop stopped after an internal error ({type(error).__name__}: {error})"
        return True
