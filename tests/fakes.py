"""Test doubles shared by tests/unit and tests/e2e (on the path through pytest's
``pythonpath``)."""

from mono_ext.runtime import health as h


class FakeHealthSource:
    """A health block a test can fail; every submitted copy is ready at the next poll (what
    ``runtime.failstop.CudaHealthSource`` gives after the step's copy lands)."""

    def __init__(self, index: int = 9, cta: int = 1) -> None:
        self.index, self.cta = index, cta  # word and CTA the failure record names
        self.words = h.health_init_words()
        self.pending: list = []

    def fail(self) -> None:
        """Record one wait that gave up: region 0, word ``index``, tag 5 wanted and 4 seen, by
        CTA ``cta`` of rank 0 at epoch 3, after 1 s (``runtime.health.RECORD_FIELDS``)."""
        self.words[h.H_FAILED] += 1
        base = h.H_RECORDS
        self.words[base : base + h.RECORD_WORDS] = [0, self.index, 5, 4, self.cta, 0, 3, 10**6]

    def submit(self, step: int) -> None:
        self.pending.append((step, list(self.words)))

    def ready(self, until_step=None):
        out, self.pending = self.pending, []
        return out
