"""FileStore: atomic files, LRU by bytes, restart recovery, crash safety, concurrent readers."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

from kvjax.kv_store import FileStore, StoreIOError
from kvjax.kv_store.file import fanout_dir

REPO = Path(__file__).resolve().parents[2]


def files(root: Path, suffix: str) -> list[Path]:
    return sorted(p for p in root.rglob(f"*{suffix}") if p.is_file())


def test_layout_one_file_per_block(tmp_path):
    s = FileStore(tmp_path, 1000)
    s.batch_put(["kvjax1-abc-00ff"], [b"12345"])
    p = tmp_path / fanout_dir("kvjax1-abc-00ff") / "kvjax1-abc-00ff.bin"
    assert p.read_bytes() == b"12345"
    assert files(tmp_path, ".tmp") == []
    s.close()


def test_lru_eviction_deletes_least_recently_used_files(tmp_path):
    s = FileStore(tmp_path, 300)
    s.batch_put(["a", "b", "c"], [b"a" * 100, b"b" * 100, b"c" * 100])
    assert s.batch_get_into(["a"], [bytearray(100)]) == [True]
    assert s.batch_put(["d"], [b"d" * 150]) == [True]
    assert s.batch_exists(["a"]) == 1 and s.batch_exists(["d"]) == 1
    assert s.batch_exists(["b"]) == 0 and s.batch_exists(["c"]) == 0
    assert sorted(p.stem for p in files(tmp_path, ".bin")) == ["a", "d"]
    assert s.used_bytes == 250 == sum(p.stat().st_size for p in files(tmp_path, ".bin"))
    assert s.batch_put(["huge"], [b"h" * 301]) == [False] and s.batch_exists(["a", "d"]) == 2
    s.close()


def test_restart_rebuilds_index_in_lru_order(tmp_path):
    s = FileStore(tmp_path, 1000)
    s.batch_put(["a", "b", "c"], [b"a" * 100, b"b" * 100, b"c" * 100])
    for i, k in enumerate(["b", "a", "c"]):  # recency order b < a < c, mirrored in mtimes
        p = tmp_path / fanout_dir(k) / f"{k}.bin"
        os.utime(p, ns=(1_000_000_000 * (i + 1), 1_000_000_000 * (i + 1)))
    s.close()
    s2 = FileStore(tmp_path, 1000)
    assert len(s2) == 3 and s2.used_bytes == 300
    out = bytearray(100)
    assert s2.batch_get_into(["c"], [out]) == [True] and bytes(out) == b"c" * 100
    s2.close()
    s3 = FileStore(tmp_path, 150)  # a smaller budget on reopen evicts the oldest: b, then a
    assert s3.batch_exists(["c"]) == 1 and s3.batch_exists(["a"]) == 0 and s3.batch_exists(["b"]) == 0
    assert [p.stem for p in files(tmp_path, ".bin")] == ["c"]
    s3.close()


def test_a_get_touches_the_file_so_restarts_keep_recency(tmp_path):
    s = FileStore(tmp_path, 1000)
    s.batch_put(["a", "b"], [b"a" * 100, b"b" * 100])
    for i, k in enumerate(["a", "b"]):
        p = tmp_path / fanout_dir(k) / f"{k}.bin"
        os.utime(p, ns=(1_000_000_000 * (i + 1),) * 2)
    s.batch_get_into(["a"], [bytearray(100)])  # a becomes the most recent
    s.close()
    s2 = FileStore(tmp_path, 150)
    assert s2.batch_exists(["a"]) == 1 and s2.batch_exists(["b"]) == 0
    s2.close()


def test_open_ignores_foreign_files_and_cleans_stray_temp_files(tmp_path):
    s = FileStore(tmp_path, 1000)
    s.batch_put(["a"], [b"1234"])
    s.close()
    sub = tmp_path / fanout_dir("b")
    sub.mkdir(exist_ok=True)
    (sub / "b.123-456-0.tmp").write_bytes(b"half a blo")  # what a crash mid-write leaves
    (tmp_path / "README").write_text("not a block")
    (tmp_path / fanout_dir("a") / "notes.txt").write_text("not a block either")
    (tmp_path / "zz").mkdir(exist_ok=True)
    (tmp_path / "zz" / "misplaced.bin").write_bytes(b"wrong fan-out dir")
    s2 = FileStore(tmp_path, 1000)
    assert s2.recovered_temp_files == 1 and files(tmp_path, ".tmp") == []
    assert len(s2) == 1 and s2.batch_exists(["b"]) == 0 and s2.batch_exists(["misplaced"]) == 0
    assert (tmp_path / "README").exists() and (tmp_path / "zz" / "misplaced.bin").exists()
    s2.close()


def test_crash_between_write_and_rename_leaves_no_key(tmp_path):
    """A real process dies (os._exit) after its temp file is written, before the rename: the
    key is absent, its previous value intact, and the next open removes the temp file."""
    s = FileStore(tmp_path, 1000)
    s.batch_put(["kept", "victim"], [b"old-kept", b"old-victim"])
    s.close()
    script = textwrap.dedent(f"""
        import os
        from kvjax.kv_store import FileStore
        s = FileStore({str(tmp_path)!r}, 1000)
        def die(src, dst):
            os._exit(17)
        os.replace = die
        s.batch_put(["victim", "new"], [b"NEW-VICTIM", b"brand-new"])
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-c", script], env=env, timeout=60, capture_output=True)
    assert r.returncode == 17, r.stderr.decode()
    assert len(files(tmp_path, ".tmp")) == 1  # the crash left its temp file behind
    s2 = FileStore(tmp_path, 1000)
    assert s2.recovered_temp_files == 1 and files(tmp_path, ".tmp") == []
    out = bytearray(10)
    assert s2.batch_get_into(["victim"], [out]) == [True] and bytes(out) == b"old-victim"
    assert s2.batch_exists(["new"]) == 0 and s2.batch_exists(["kept"]) == 1
    s2.close()


def test_failed_rename_reports_false_and_leaves_nothing(tmp_path, monkeypatch):
    s = FileStore(tmp_path, 1000)
    s.batch_put(["a"], [b"first"])

    def broken(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken)
    assert s.batch_put(["a", "b"], [b"second", b"other"]) == [False, False]
    monkeypatch.undo()
    assert files(tmp_path, ".tmp") == [] and s.batch_exists(["b"]) == 0
    out = bytearray(5)
    assert s.batch_get_into(["a"], [out]) == [True] and bytes(out) == b"first"
    assert s.used_bytes == 5 and s.stats.put_failures == 2
    s.close()


def test_fsync_mode_round_trips(tmp_path):
    s = FileStore(tmp_path, 1000, fsync=True)
    assert s.batch_put(["a"], [b"durable"]) == [True]
    out = bytearray(7)
    assert s.batch_get_into(["a"], [out]) == [True] and bytes(out) == b"durable"
    s.close()


def test_one_store_per_directory(tmp_path):
    s = FileStore(tmp_path, 1000)
    with pytest.raises(StoreIOError, match="in use"):
        FileStore(tmp_path, 1000)
    s.close()
    FileStore(tmp_path, 1000).close()  # free again once closed


def test_file_deleted_behind_the_store_is_a_miss(tmp_path):
    s = FileStore(tmp_path, 1000)
    s.batch_put(["a"], [b"1234"])
    (tmp_path / fanout_dir("a") / "a.bin").unlink()
    assert s.batch_get_into(["a"], [bytearray(4)]) == [False]
    assert s.batch_exists(["a"]) == 0 and s.used_bytes == 0
    s.close()


def test_concurrent_readers_see_whole_values_while_writers_replace_and_evict(tmp_path):
    """Readers never get a torn value: each success holds one writer's complete pattern."""
    size = 64 << 10
    s = FileStore(tmp_path, 6 * size)  # room for 6 of 8 keys: evictions run all the time
    keys = [f"k{i}" for i in range(8)]
    s.batch_put(keys, [np.full(size, 0, np.uint8)] * 8)
    errors: list[str] = []
    stop = threading.Event()

    def writer(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for n in range(60):
            k = keys[int(rng.integers(8))]
            s.batch_put([k], [np.full(size, (seed * 60 + n) % 251 + 1, np.uint8)])

    def reader(seed: int) -> None:
        rng = np.random.default_rng(100 + seed)
        buf = np.empty(size, np.uint8)
        while not stop.is_set():
            k = keys[int(rng.integers(8))]
            if s.batch_get_into([k], [buf]) == [True] and not (buf == buf[0]).all():
                errors.append(f"torn read of {k}")

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(3)]
    writers = [threading.Thread(target=writer, args=(i,)) for i in range(2)]
    for t in threads + writers:
        t.start()
    for t in writers:
        t.join(60)
    stop.set()
    for t in threads:
        t.join(60)
    assert errors == []
    assert s.used_bytes <= 6 * size and s.used_bytes == sum(p.stat().st_size for p in files(tmp_path, ".bin"))
    assert files(tmp_path, ".tmp") == []
    s.close()
