"""The HTTP store against a real nginx (hit, miss, upload) and a real misbehaving server (faults)."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
from helpers.blobs import random_blob

from cubinstore import (
    BadArgumentError,
    Digest,
    IntegrityError,
    MissingBlobError,
    RemoteUnavailableError,
    Store,
)
from cubinstore.store import HttpLayer, LocalLayer, MemoryLayer

pytestmark = pytest.mark.usefixtures("clean_env")


def blob(n: int = 10000, seed: int | None = None) -> tuple[Digest, bytes]:
    return random_blob(n, seed)


def fast(url: str, **kw: float) -> HttpLayer:
    """Short timeouts and backoff so fault tests stay quick."""
    options = dict(connect_timeout=2.0, read_timeout=2.0, retries=2, deadline=20.0, backoff=0.01, max_backoff=0.05)
    options.update(kw)
    return HttpLayer(url, **options)  # type: ignore[arg-type]


# -- nginx ----------------------------------------------------------------------------------------

def test_nginx_hit_fills_the_local_store(nginx, tmp_path: Path) -> None:
    url = nginx.base()
    digest, data = blob()
    fast(url).put(digest, data)
    assert nginx.file(url, digest.hex).read_bytes() == data
    local = LocalLayer(tmp_path)
    store = Store([MemoryLayer(), local, fast(url)])
    assert store.get(digest, len(data), name="axpy/f32/vec4/sm_90a") == data
    assert local.path_for(digest).read_bytes() == data
    assert store.stats.misses == 1 and store.stats.bytes_fetched == len(data)
    # Second time: local hit, no request.
    before = nginx.requests("GET", digest.hex)
    assert Store([LocalLayer(tmp_path), fast(url)]).get(digest, len(data)) == data
    assert nginx.requests("GET", digest.hex) == before == 1


def test_nginx_404_is_a_missing_blob_without_retries(nginx, tmp_path: Path) -> None:
    url = nginx.base()
    digest, data = blob()
    with pytest.raises(MissingBlobError) as info:
        Store([LocalLayer(tmp_path), fast(url, retries=5)]).get(digest, len(data), name="k1")
    message = str(info.value)
    assert message.startswith(f"{digest} (k1) ({len(data)} bytes) not available: local store {tmp_path}: miss; remote {url}: miss")
    assert nginx.requests("GET", digest.hex) == 1
    assert not LocalLayer(tmp_path).path_for(digest).exists()


def test_wrong_bytes_at_the_right_length_on_nginx_are_never_stored(nginx, tmp_path: Path) -> None:
    url = nginx.base()
    digest, data = blob()
    path = nginx.file(url, digest.hex)
    path.parent.mkdir(parents=True)
    path.write_bytes(bytes([data[0] ^ 0x80]) + data[1:])  # a cache that serves a damaged blob
    local = LocalLayer(tmp_path)
    store = Store([local, fast(url)])
    with pytest.raises(IntegrityError) as info:
        store.get(digest, len(data), name="k2")
    assert f"remote {url}: digest mismatch for {digest} (k2) from remote {url}: expected {digest}, got sha256:" in str(info.value)
    assert not local.path_for(digest).exists() and store.stats.verification_failures == 1
    assert nginx.requests("GET", digest.hex) == 1  # bad bytes are not retried


def test_second_remote_serves_when_the_first_misses(nginx, tmp_path: Path) -> None:
    first, second = nginx.base(), nginx.base()
    digest, data = blob()
    fast(second).put(digest, data)
    assert Store([LocalLayer(tmp_path), fast(first), fast(second)]).get(digest, len(data)) == data


def test_basic_auth_credentials_never_appear_in_messages(nginx) -> None:
    store = fast(nginx.base().replace("http://", "http://user:s3cret@"))
    assert "s3cret" not in store.url and "user" not in store.url
    digest, data = blob()
    with pytest.raises(MissingBlobError) as info:
        Store([store]).get(digest, len(data))
    assert "s3cret" not in str(info.value)


@pytest.mark.parametrize("url", ["ftp://x/cas", "http://", "http://h/p?q=1", "http://h/p#f", "http://h:99999/", "file:///tmp", "http://h/a b"])
def test_malformed_remote_url_is_a_bad_argument(url: str) -> None:
    with pytest.raises(BadArgumentError, match=r"^invalid remote URL"):
        HttpLayer(url)


# -- faults from a real misbehaving server --------------------------------------------------------

def test_malformed_digest_is_rejected_before_any_request(faulty) -> None:
    store = Store([fast(faulty.url)])
    for bad in ("sha256:../../x", "sha256:" + "g" * 64, "sha256:" + "a" * 63):
        with pytest.raises(BadArgumentError, match=r"^invalid digest"):
            store.get(bad)
    assert sum(faulty.counts.values()) == 0


def test_5xx_then_success_is_retried_with_backoff(faulty, tmp_path: Path) -> None:
    digest, data = blob()
    path = f"/cas/{digest.hex}"
    faulty.script(path, [("status", 503), ("status", 500), ("body", data)])
    local = LocalLayer(tmp_path)
    assert Store([local, fast(faulty.url, retries=3)]).get(digest, len(data)) == data
    assert faulty.count("GET", path) == 3
    assert local.path_for(digest).read_bytes() == data


def test_persistent_5xx_gives_up_after_bounded_retries(faulty, tmp_path: Path) -> None:
    digest, data = blob()
    path = f"/cas/{digest.hex}"
    faulty.script(path, [("status", 502)])
    with pytest.raises(RemoteUnavailableError) as info:
        Store([LocalLayer(tmp_path), fast(faulty.url, retries=2)]).get(digest, len(data), name="k3")
    assert f"GET {faulty.url}/cas/{digest.hex} failed after 3 attempts" in str(info.value)
    assert "HTTP 502" in str(info.value)
    assert faulty.count("GET", path) == 3


def test_403_is_not_retried(faulty) -> None:
    digest, data = blob()
    faulty.script(f"/cas/{digest.hex}", [("status", 403)])
    with pytest.raises(RemoteUnavailableError, match=r".*HTTP 403, not retried"):
        Store([fast(faulty.url, retries=4)]).get(digest, len(data))
    assert faulty.count("GET", f"/cas/{digest.hex}") == 1


def test_read_timeout_is_retried_then_a_typed_error(faulty) -> None:
    digest, data = blob()
    path = f"/cas/{digest.hex}"
    faulty.script(path, [("sleep", 3.0, ("body", data))])
    start = time.monotonic()
    with pytest.raises(RemoteUnavailableError, match=r".*failed after 2 attempts .*timed out"):
        Store([fast(faulty.url, read_timeout=0.3, retries=1)]).get(digest, len(data))
    assert time.monotonic() - start < 2.5
    assert faulty.count("GET", path) == 2


def test_slow_server_then_fast_answer_succeeds(faulty) -> None:
    digest, data = blob()
    path = f"/cas/{digest.hex}"
    faulty.script(path, [("sleep", 1.0, ("body", data)), ("body", data)])
    assert Store([fast(faulty.url, read_timeout=0.3, retries=2)]).get(digest, len(data)) == data
    assert faulty.count("GET", path) == 2


def test_total_deadline_bounds_retries(faulty) -> None:
    digest, data = blob()
    faulty.script(f"/cas/{digest.hex}", [("sleep", 0.2, ("status", 503))])
    start = time.monotonic()
    with pytest.raises(RemoteUnavailableError, match=r".*total deadline of 1s passed"):
        Store([fast(faulty.url, retries=1000, deadline=1.0)]).get(digest, len(data))
    assert time.monotonic() - start < 2.0


def test_connection_refused_is_retried_then_typed(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed when the block ends: nothing listens there
    digest, data = blob()
    with pytest.raises(RemoteUnavailableError, match=r".*failed after 3 attempts .*cannot connect: Connection refused"):
        Store([LocalLayer(tmp_path), fast(f"http://127.0.0.1:{port}", retries=2)]).get(digest, len(data))


def test_connect_timeout_against_a_full_accept_queue() -> None:
    # A listener that never accepts, its queue filled: the kernel drops further SYNs.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    try:
        for _ in range(8):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            fillers.append(s)
        time.sleep(0.1)
        digest, data = blob()
        start = time.monotonic()
        with pytest.raises(RemoteUnavailableError, match=r".*failed after 2 attempts"):
            Store([fast(f"http://127.0.0.1:{port}", connect_timeout=0.3, read_timeout=0.3, retries=1)]).get(digest, len(data))
        assert time.monotonic() - start < 3.0
    finally:
        for s in fillers:
            s.close()
        listener.close()


def test_wrong_bytes_of_the_right_length_is_an_integrity_error(faulty, tmp_path: Path) -> None:
    digest, data = blob()
    path = f"/cas/{digest.hex}"
    faulty.script(path, [("body", bytes(len(data)))])
    local = LocalLayer(tmp_path)
    store = Store([local, fast(faulty.url, retries=3)])
    with pytest.raises(IntegrityError, match=rf"^{digest} \(k4\) \({len(data)} bytes\) not available: .*digest mismatch"):
        store.get(digest, len(data), name="k4")
    assert faulty.count("GET", path) == 1
    assert not local.path_for(digest).exists() and list(local.root.rglob(".tmp.*")) == []
    assert store.stats.verification_failures == 1


def test_truncated_body_is_retried_then_succeeds(faulty, tmp_path: Path) -> None:
    digest, data = blob()
    path = f"/cas/{digest.hex}"
    faulty.script(path, [("declare", len(data), data[:1000]), ("body", data)])
    local = LocalLayer(tmp_path)
    assert Store([local, fast(faulty.url)]).get(digest, len(data)) == data
    assert faulty.count("GET", path) == 2
    assert local.path_for(digest).read_bytes() == data


def test_always_truncated_body_is_a_typed_error_and_nothing_stored(faulty, tmp_path: Path) -> None:
    digest, data = blob()
    path = f"/cas/{digest.hex}"
    faulty.script(path, [("declare", len(data), data[:-1])])
    local = LocalLayer(tmp_path)
    with pytest.raises(RemoteUnavailableError, match=r".*truncated body: got 9999 of 10000 bytes"):
        Store([local, fast(faulty.url, retries=1)]).get(digest, len(data))
    assert not local.root.joinpath("v1", "cas").exists() or not any(local.root.joinpath("v1", "cas").rglob("*" + digest.hex + "*"))


def test_connection_reset_is_retried(faulty) -> None:
    digest, data = blob()
    path = f"/cas/{digest.hex}"
    faulty.script(path, [("reset",), ("body", data)])
    assert Store([fast(faulty.url)]).get(digest, len(data)) == data
    assert faulty.count("GET", path) == 2


def test_declared_length_above_expected_size_is_refused_without_download(faulty) -> None:
    digest, data = blob()
    faulty.script(f"/cas/{digest.hex}", [("declare", 10**12, data)])
    with pytest.raises(IntegrityError, match=rf".*server declares {10**12} bytes, expected {len(data)}; not downloaded"):
        Store([fast(faulty.url)]).get(digest, len(data))


def test_endless_body_without_length_stops_at_the_expected_size(faulty) -> None:
    digest, data = blob()
    faulty.script(f"/cas/{digest.hex}", [("endless",)])
    start = time.monotonic()
    with pytest.raises(IntegrityError, match=rf".*body longer than the expected {len(data)} bytes; download stopped"):
        Store([fast(faulty.url)]).get(digest, len(data))
    assert time.monotonic() - start < 5


def test_body_longer_than_declared_is_cut_at_the_declared_size(faulty) -> None:
    digest, data = blob()
    faulty.script(f"/cas/{digest.hex}", [("declare", len(data), data + b"trailing garbage" * 1000)])
    assert Store([fast(faulty.url)]).get(digest, len(data)) == data


def test_unsized_get_is_capped(faulty) -> None:
    digest, _ = blob()
    faulty.script(f"/cas/{digest.hex}", [("endless",)])
    with pytest.raises(IntegrityError, match=r".*body longer than the expected 67108864 bytes"):
        Store([fast(faulty.url)]).get(digest)


def test_put_errors_are_typed(faulty) -> None:
    digest, data = blob()
    faulty.script(f"/cas/{digest.hex}", [("status", 405)])
    with pytest.raises(RemoteUnavailableError, match=r"^PUT .*: HTTP 405, not retried; does the server accept PUT"):
        fast(faulty.url).put(digest, data)


# -- a slow sender, a black hole, credentials in bad URLs -----------------------------------------

class Dripper:
    """A loopback server answering every request one byte every ``interval`` seconds, for at
    most ``limit`` seconds: the whole response (``"headers"``), or only the body (``"body"``)."""

    def __init__(self, body: bytes, mode: str, interval: float, limit: float = 40.0) -> None:
        import threading

        self.body, self.mode, self.interval, self.limit = body, mode, interval, limit
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        import threading

        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._drip, args=(conn,), daemon=True).start()

    def _drip(self, conn: socket.socket) -> None:
        head = f"HTTP/1.1 200 OK\r\nContent-Length: {len(self.body)}\r\nConnection: close\r\n\r\n".encode()
        end = time.monotonic() + self.limit
        try:
            conn.recv(65536)
            dripped = head + self.body
            if self.mode == "body":
                conn.sendall(head)
                dripped = self.body
            for i in range(len(dripped)):
                if self.stop.is_set() or time.monotonic() > end:
                    break
                conn.sendall(dripped[i:i + 1])
                time.sleep(self.interval)
        except OSError:
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


@pytest.mark.parametrize("mode, interval", [("headers", 0.2), ("body", 0.01)])
def test_deadline_holds_against_a_server_sending_one_byte_at_a_time(mode: str, interval: float) -> None:
    digest, data = blob(2000)
    server = Dripper(data, mode, interval)  # 12 s of headers, or 20 s of body, without a pause over 0.2 s
    try:
        start = time.monotonic()
        with pytest.raises(RemoteUnavailableError, match=r".*total deadline of 1.5s passed"):
            Store([fast(server.url, read_timeout=1.0, retries=3, deadline=1.5)]).get(digest, len(data))
        assert time.monotonic() - start < 3.0
    finally:
        server.close()


def black_hole() -> socket.socket:
    """A port that accepts connections (the kernel's backlog) and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    return sock


def test_a_black_holed_remote_is_skipped_after_it_times_out_once(faulty, tmp_path: Path) -> None:
    hole = black_hole()
    try:
        blobs = [blob(3000, seed=i) for i in range(8)]
        for digest, data in blobs:
            faulty.stored[f"/cas/{digest.hex}"] = data
        first = fast(f"http://127.0.0.1:{hole.getsockname()[1]}", read_timeout=0.5, retries=1, deadline=0.8)
        store = Store([LocalLayer(tmp_path), first, fast(faulty.url)])
        start = time.monotonic()
        for digest, data in blobs:
            assert store.get(digest, len(data)) == data
        elapsed = time.monotonic() - start
        # One deadline for the first blob, then the dead remote is skipped; not 8 deadlines.
        assert elapsed < 0.8 + 2.0, f"{elapsed:.1f}s"
        with pytest.raises(RemoteUnavailableError, match=r"^GET http://127\.0\.0\.1:\d+/cas/\w+ skipped: .*timed out"):
            first.read(blobs[0][0], 3000)
    finally:
        hole.close()


def test_the_circuit_breaker_tries_the_remote_again_after_its_reset_time(faulty) -> None:
    digest, data = blob()
    path = f"/cas/{digest.hex}"
    faulty.script(path, [("sleep", 2.0, ("body", data)), ("sleep", 2.0, ("body", data)), ("body", data)])
    remote = fast(faulty.url, read_timeout=0.3, retries=1, deadline=5.0, breaker_reset=0.5)
    with pytest.raises(RemoteUnavailableError):
        remote.read(digest, len(data))
    with pytest.raises(RemoteUnavailableError, match=r".* skipped: "):
        remote.read(digest, len(data))
    assert faulty.count("GET", path) == 2
    time.sleep(0.6)  # the breaker's reset time, not a synchronisation
    assert remote.read(digest, len(data)) == data


SECRET_URLS = [
    "http://user:s3cret@host:99999/cas",       # bad port
    "http://user:s3cret@host/cas?x=1",         # query
    "http://user:s3cret@host/c as",            # space
    "ftp://user:s3cret@host/cas",              # other scheme
    "http://user:s3cret@/cas",                 # no host
    "http://user:s3cret@host/cas#frag",        # fragment
    "user:s3cret@host/cas",                    # no scheme
    "http://user:s3/cret@host/cas",            # a slash in the password
]


@pytest.mark.parametrize("url", SECRET_URLS)
def test_a_malformed_url_never_shows_its_credentials(url: str) -> None:
    with pytest.raises(BadArgumentError) as info:
        HttpLayer(url)
    message = str(info.value)
    assert message.startswith("invalid remote URL ")
    assert "s3cret" not in message and "cret" not in message and "user" not in message, message
