"""`FileStore`: one file per block under a directory, atomic writes, an LRU bounded by bytes,
and an index rebuilt from the directory on open, so a restart finds what was stored before."""
from __future__ import annotations

import fcntl
import hashlib
import itertools
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from kvjax.kv_store.errors import StoreClosedError, StoreIOError
from kvjax.kv_store.interface import KEY_PATTERN, check_batch, check_keys, longest_present_prefix
from kvjax.kv_store.stats import StoreStats

VALUE_SUFFIX = ".bin"
TEMP_SUFFIX = ".tmp"
LOCK_NAME = ".kvjax-store.lock"


def fanout_dir(key: str) -> str:
    """One of 256 sub-directories (two hex digits of a digest of the key), so no directory
    grows past a few thousand entries at millions of blocks."""
    return hashlib.blake2b(key.encode("ascii"), digest_size=1).hexdigest()


class FileStore:
    """Blocks as files `<root>/<xx>/<key>.bin`, at most `max_bytes` of values in all.

    Writes go to a unique temp file beside the target and are renamed over it with `os.replace`
    (atomic on POSIX), so a key is absent or complete even if the process dies mid-write; the
    temp files such a crash leaves are deleted on the next open. `fsync=False` (the default)
    survives a process crash but not a power loss or kernel crash (the rename may reach the
    disk before the data); `fsync=True` syncs each file before its rename and the directory
    after it, which makes a put durable once it returns True, at one or two disk flushes per
    block.

    The LRU order is kept in memory and mirrored in file modification times (a get touches the
    file), so the index rebuilt on open evicts the least recently used files first. One
    FileStore owns a directory at a time (an exclusive `flock` on `<root>/.kvjax-store.lock`;
    a second one, in any process, gets `StoreIOError`). Inside the process every method is
    thread-safe: renames, deletions and index changes happen under one lock, reads and the
    data writes outside it; a reader that opened a file keeps reading the complete old value
    even if it is evicted or replaced meanwhile (POSIX unlink semantics).
    """

    def __init__(self, root: str | os.PathLike[str], max_bytes: int, *, fsync: bool = False) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes must be an int >= 0, got {max_bytes!r}")
        if not isinstance(fsync, bool):
            raise ValueError(f"fsync must be a bool, got {fsync!r}")
        self.root = os.fspath(root)
        self.max_bytes = max_bytes
        self.fsync = fsync
        self.stats = StoreStats()
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> size, least recently used first
        self._used = 0
        self._closed = False
        self._tmp_ids = itertools.count()
        self._last_ns = 0  # the newest modification time given to a file (strictly increasing)
        self.recovered_temp_files = 0  # stray temp files the last open deleted
        try:
            os.makedirs(self.root, exist_ok=True)
            self._lock_fd = os.open(os.path.join(self.root, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise StoreIOError(f"cannot open store directory {self.root!r}: {e}") from e
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._lock_fd)
            raise StoreIOError(f"store directory {self.root!r} is in use by another FileStore") from None
        self._rebuild_index()

    # ------------------------------------------------------------------ index
    def _rebuild_index(self) -> None:
        """Index the complete values in the directory (oldest modification first), delete stray
        temp files, and evict down to `max_bytes` if the budget shrank since the last run."""
        found: list[tuple[int, str, int]] = []
        with os.scandir(self.root) as top:
            subdirs = [e.path for e in top if e.is_dir(follow_symlinks=False) and len(e.name) == 2]
        for sub in subdirs:
            with os.scandir(sub) as it:
                for e in it:
                    if not e.is_file(follow_symlinks=False):
                        continue
                    if e.name.endswith(TEMP_SUFFIX):
                        self._unlink(e.path)
                        self.recovered_temp_files += 1
                        continue
                    if not e.name.endswith(VALUE_SUFFIX):
                        continue  # not ours: leave it alone
                    key = e.name[: -len(VALUE_SUFFIX)]
                    if KEY_PATTERN.fullmatch(key) is None or fanout_dir(key) != os.path.basename(sub):
                        continue
                    st = e.stat(follow_symlinks=False)
                    found.append((st.st_mtime_ns, key, st.st_size))
        found.sort()
        self._last_ns = found[-1][0] if found else 0
        for _, key, size in found:
            self._index[key] = size
            self._used += size
        self._evict_locked(0)

    def _path(self, key: str) -> str:
        return os.path.join(self.root, fanout_dir(key), key + VALUE_SUFFIX)

    @staticmethod
    def _unlink(path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def _stamp_locked(self, path: str) -> None:
        """Give the file a modification time later than every other one this store set, so the
        next open recovers the exact LRU order (file-system clocks are often coarser than the
        gap between two puts, which would leave ties)."""
        self._last_ns = max(time.time_ns(), self._last_ns + 1)
        try:
            os.utime(path, ns=(self._last_ns, self._last_ns))
        except OSError:
            pass  # only the order after a restart suffers

    def _evict_locked(self, incoming: int) -> None:
        while self._index and self._used + incoming > self.max_bytes:
            key, size = self._index.popitem(last=False)
            self._used -= size
            self._unlink(self._path(key))
            self.stats.evictions += 1

    @property
    def used_bytes(self) -> int:
        return self._used

    def __len__(self) -> int:
        return len(self._index)

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"FileStore at {self.root!r} is closed")

    # ------------------------------------------------------------------ the interface
    def batch_exists(self, keys: Sequence[str]) -> int:
        """Answered from the index (no file-system calls): a hint, as for every store."""
        ks = check_keys(keys)
        with self._lock:
            self._check_open()
            return longest_present_prefix([k in self._index for k in ks])

    def batch_put(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[bool]:
        ks, views = check_batch(keys, buffers, writable=False)
        self._check_open()
        return [self._put_one(k, v) for k, v in zip(ks, views, strict=True)]

    def _put_one(self, key: str, view: memoryview) -> bool:
        n = view.nbytes
        if n > self.max_bytes:
            with self._lock:
                self.stats.put_failures += 1
            return False
        path = self._path(key)
        tmp = f"{path[: -len(VALUE_SUFFIX)]}.{os.getpid()}-{threading.get_ident()}-{next(self._tmp_ids)}{TEMP_SUFFIX}"
        try:
            try:
                f = open(tmp, "wb")
            except FileNotFoundError:  # first block of this fan-out dir (a mkdir per put would cost a syscall)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                f = open(tmp, "wb")
            with f:
                f.write(view)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            with self._lock:
                self._check_open()
                os.replace(tmp, path)
                self._stamp_locked(path)
                old = self._index.pop(key, None)
                if old is not None:
                    self._used -= old
                self._index[key] = n  # newest: the eviction below reaches it last, and never (n <= max_bytes)
                self._used += n
                self._evict_locked(0)
                self.stats.puts += 1
                self.stats.bytes_written += n
            if self.fsync:
                dfd = os.open(os.path.dirname(path), os.O_RDONLY)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)
            return True
        except OSError:
            self._unlink(tmp)
            with self._lock:
                self.stats.put_failures += 1
            return False
        except BaseException:  # closed meanwhile, interrupted: no temp file may outlive the put
            self._unlink(tmp)
            raise

    def batch_get_into(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[bool]:
        ks, views = check_batch(keys, buffers, writable=True)
        self._check_open()
        return [self._get_one(k, v) for k, v in zip(ks, views, strict=True)]

    def _get_one(self, key: str, view: memoryview) -> bool:
        with self._lock:
            size = self._index.get(key)
            if size is None:
                self.stats.misses += 1
                return False
        if size != view.nbytes:
            with self._lock:
                self.stats.size_mismatches += 1
            return False
        path = self._path(key)
        try:
            with open(path, "rb", buffering=0) as f:
                if os.fstat(f.fileno()).st_size != view.nbytes:  # replaced by a put of another size
                    with self._lock:
                        self.stats.size_mismatches += 1
                    return False
                got = 0
                while got < view.nbytes:
                    r = f.readinto(view[got:])
                    if not r:
                        break
                    got += r
            if got != view.nbytes:
                return False
        except FileNotFoundError:
            with self._lock:  # evicted or removed between the index look-up and the open
                self.stats.misses += 1
                if key in self._index and not os.path.exists(path):  # deleted behind our back
                    self._used -= self._index.pop(key)
            return False
        except OSError:
            return False
        with self._lock:
            if key in self._index:  # a successful read is a use (a failed one is not)
                self._index.move_to_end(key)
                self._stamp_locked(path)  # mirror the LRU order in mtimes for the next open
            self.stats.hits += 1
            self.stats.bytes_read += view.nbytes
        return True

    def remove(self, keys: Sequence[str]) -> int:
        ks = check_keys(keys)
        n = 0
        with self._lock:
            self._check_open()
            for k in ks:
                size = self._index.pop(k, None)
                if size is not None:
                    self._used -= size
                    self._unlink(self._path(k))
                    n += 1
        return n

    def close(self) -> None:
        """Release the directory lock; the files stay for the next open."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            finally:
                os.close(self._lock_fd)
