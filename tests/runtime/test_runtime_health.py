"""Health block: the Python mirror must match the device layout (CPU)."""

import ctypes

import pytest

from mono_ext.runtime import health as h


def test_ctypes_mirror_matches_offsets():
    assert ctypes.sizeof(h.HealthBlockC) == h.HEALTH_WORDS * 4
    assert h.HealthBlockC.failed.offset == h.H_FAILED * 4
    assert h.HealthBlockC.magic.offset == h.H_MAGIC * 4
    assert h.HealthBlockC.records.offset == h.H_RECORDS * 4
    rec = h.HealthBlockC.records.size // h.MAX_RECORDS
    assert rec == h.RECORD_WORDS * 4
    # field order inside a record is the order the device writes them (rec + 0 .. rec + 7)
    from mono_ext.runtime.health import _RecordC

    for i, name in enumerate(h.RECORD_FIELDS):
        assert getattr(_RecordC, name).offset == 4 * i
    assert h.RECORD_FIELDS[:6] == ("region", "index", "wanted_tag", "seen_tag", "cta", "rank")
    assert h.CTRL_WORDS * 8 == 32 and len({h.CTRL_EPOCH, h.CTRL_DEADLINE_NS, h.CTRL_RANK}) == 3


def _block(records):
    words = h.health_init_words()
    words[h.H_FAILED] = len(records)
    for i, rec in enumerate(records[: h.MAX_RECORDS]):
        base = h.H_RECORDS + i * h.RECORD_WORDS
        words[base : base + h.RECORD_WORDS] = rec
    return words


def test_decode_round_trip_through_ctypes():
    recs = [[0, 17, -2, 5, 3, 1, 9, 1_000_000], [0, 4, 7, 0, 1, 1, 9, 999_999]]
    words = _block(recs)
    blob = (ctypes.c_int32 * h.HEALTH_WORDS)(*words)
    c = h.HealthBlockC.from_buffer_copy(blob)
    assert c.failed == 2 and c.magic == h._s32(h.HEALTH_MAGIC)
    assert c.records[0].index == 17 and c.records[1].waited_us == 999_999
    s = h.decode_health(words, rank=1, step=4)
    assert not s.ok and s.failed_waits == 2 and s.step == 4
    assert s.records[0].wanted_tag == 0xFFFFFFFE  # tags are unsigned on the host
    assert s.records[0] == h.WaitRecord(0, 17, 0xFFFFFFFE, 5, 3, 1, 9, 1_000_000)
    text = s.describe(lambda r, i: f"k.ar[{i}]")
    assert "k.ar[17]" in text and "rank 1 CTA 3" in text


def test_decode_healthy_and_overflow():
    assert h.decode_health(h.health_init_words(), rank=0).ok
    many = [[0, i, 1, 0, i, 0, 1, 10] for i in range(11)]
    s = h.decode_health(_block(many), rank=0)
    assert s.failed_waits == 11 and len(s.records) == h.MAX_RECORDS
    assert "3 more not recorded" in s.describe()


def test_decode_refuses_foreign_buffer():
    with pytest.raises(h.HealthLayoutError, match="magic"):
        h.decode_health([0] * h.HEALTH_WORDS, rank=0)
    with pytest.raises(h.HealthLayoutError, match="words"):
        h.decode_health([0] * 3, rank=0)


def test_ctrl_init():
    w = h.ctrl_init_words(3, 0.5)
    assert w[h.CTRL_EPOCH] == 0 and w[h.CTRL_RANK] == 3 and w[h.CTRL_DEADLINE_NS] == 500_000_000
    with pytest.raises(ValueError):
        h.ctrl_init_words(0, 0)
