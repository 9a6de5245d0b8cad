"""Other local users cannot obtain the heap's memory handles (ring_core.runtime.heap.private_handle_passing).

iris passes the handles (file descriptors) between the ranks of a job over AF_UNIX sockets. These tests run
iris's own fd-passing code (iris.host.distributed.fd_passing) on CPU, with plain file descriptors standing
in for the GPU memory handles: the listening sockets sit in a private directory, the exchange still works
between the processes of one user, a process of another user can neither connect nor plant a socket, and a
connection whose peer is another user is refused before any handle is sent. Switching to another user
needs root; where the tests do not run as root those parts are skipped, saying so, and the checks of the
directory's owner and mode bits (which are what the kernel enforces) remain.
"""

import os

# iris is imported by these tests: keep its Triton functions interpretable for the simulator tests that
# may share this process (as tests/cpu/test_simulate.py does).
os.environ.setdefault("TRITON_INTERPRET", "1")

import socket  # noqa: E402
import stat  # noqa: E402
import tempfile  # noqa: E402

import pytest  # noqa: E402

from ring_core.runtime import heap  # noqa: E402

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="switching to another user's uid needs root")
# The children of os.fork below only switch uid and make one socket call before os._exit: they touch no
# lock another thread (JAX's) could hold, so JAX's warning about forking a threaded process does not apply.
# (A fresh interpreter run as another user is not an option: this venv's python need not be readable by it.)
fork_ok = pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called:RuntimeWarning")


def _as_other_user(fn, uid=NOBODY) -> int:
    """Run ``fn()`` in a forked child switched to ``uid``; return its exit code (fn's return value)."""
    pid = os.fork()
    if pid == 0:  # child
        code = 99
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            code = fn()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _socket_op(op: str, path) -> int:
    """``op`` ("connect" or "bind") on a fresh AF_UNIX socket: 0 done; 1 refused for lack of permission;
    2 another error."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        getattr(s, op)(path)
        return 0
    except PermissionError:
        return 1
    except OSError:
        return 2
    finally:
        s.close()


def _connect(path) -> int:
    return _socket_op("connect", path)


def test_sockets_are_created_in_a_private_directory():
    from iris.host.distributed import fd_passing
    from iris.host.memory import symmetric_heap

    original = fd_passing.make_rank_sock_path, symmetric_heap.setup_fd_infrastructure
    with heap.private_handle_passing() as sock_dir:
        path = fd_passing.make_rank_sock_path("iris-dmabuf", 1, 7)
        assert os.path.dirname(path) == sock_dir
        assert os.path.basename(path) == f"iris-dmabuf-{os.getpid()}-1-7.sock"  # iris's own name
        st = os.lstat(sock_dir)
        assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()
        assert stat.S_IMODE(st.st_mode) == 0o700, oct(st.st_mode)  # no one else may enter, list or create
        assert os.path.basename(sock_dir).startswith("ring-attn-iris-") and len(path) <= 107
        assert symmetric_heap.setup_fd_infrastructure is not original[1]
    assert not os.path.exists(sock_dir)
    assert (fd_passing.make_rank_sock_path, symmetric_heap.setup_fd_infrastructure) == original


def test_socket_directory_falls_back_to_tmp_for_a_long_tmpdir(monkeypatch, tmp_path):
    deep = tmp_path / ("d" * 90)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    with heap.private_handle_passing() as sock_dir:
        assert os.path.dirname(sock_dir) == "/tmp"


@needs_root
@fork_ok
def test_another_user_cannot_connect_or_plant_a_socket():
    """A listener bound where iris binds (under a permissive umask, the worst case) is reachable by its own
    user but not by another; another user cannot create the path first either. The same listener at iris's
    default place, /tmp, is reachable by anyone: that is what the private directory prevents."""
    from iris.host.distributed import fd_passing

    old_umask = os.umask(0)
    try:
        with heap.private_handle_passing():
            path = fd_passing.make_rank_sock_path("iris-dmabuf", 0, 1)
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(path)
            listener.listen(4)
            try:
                assert _connect(path) == 0  # the job's own user
                assert _as_other_user(lambda: _connect(path)) == 1
                squat = path + ".other"
                assert _as_other_user(lambda: _bind(squat)) == 1
            finally:
                listener.close()
        exposed = os.path.join("/tmp", os.path.basename(path))  # where iris would have put it
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(exposed)
        listener.listen(4)
        try:
            assert _as_other_user(lambda: _connect(exposed)) == 0
        finally:
            listener.close()
            os.unlink(exposed)
    finally:
        os.umask(old_umask)


def _bind(path) -> int:
    return _socket_op("bind", path)


def test_peer_of_another_user_is_refused_before_any_handle():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid, uid, _ = heap.peer_credentials(a)
    assert (pid, uid) == (os.getpid(), os.geteuid())
    heap.check_handle_peers({1: a})  # same user: accepted
    with pytest.raises(PermissionError, match=rf"rank 1 leads to process {os.getpid()} of user {uid}, not to a "
                                              rf"process of this job's user \({uid + 1}\).*no handle was sent"):
        heap.check_handle_peers({1: a}, uid=uid + 1)
    assert a.fileno() == -1  # closed
    b.close()


@needs_root
@fork_ok
def test_connection_from_another_user_is_refused():
    """A real connection made by another user's process (to a socket outside the private directory, as if
    redirected there through the rendezvous store) fails the peer check."""
    sock_dir = tempfile.mkdtemp()
    os.chmod(sock_dir, 0o755)
    path = os.path.join(sock_dir, "listener.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    os.chmod(path, 0o777)
    listener.listen(1)
    try:
        child = os.fork()
        if child == 0:
            code = 1
            try:
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(path)
                s.recv(1)  # hold the connection until the parent has checked it
                code = 0
            finally:
                os._exit(code)
        conn, _ = listener.accept()
        assert heap.peer_credentials(conn)[1] == NOBODY
        with pytest.raises(PermissionError, match=rf"leads to process {child} of user {NOBODY}"):
            heap.check_handle_peers({3: conn})
        os.waitpid(child, 0)
    finally:
        listener.close()
        os.unlink(path)
        os.rmdir(sock_dir)


def test_unknown_iris_is_refused(monkeypatch):
    from iris.host.distributed import fd_passing

    monkeypatch.delattr(fd_passing, "make_rank_sock_path")
    with pytest.raises(RuntimeError, match=r"no longer creates its memory-handle sockets .*refusing to create"):
        with heap.private_handle_passing():
            pass


def _exchange_task(rank, world):
    """iris's real fd-passing set-up between the processes of a gloo group, under private_handle_passing:
    rank 1 sends rank 0 a file descriptor (a pipe with a message in it, standing in for a memory handle)."""
    import torch.distributed as dist
    from iris.host.distributed import fd_passing
    from iris.host.memory import symmetric_heap

    with heap.private_handle_passing() as sock_dir:
        conns = symmetric_heap.setup_fd_infrastructure(rank, world)  # what iris's SymmetricHeap calls
        dirs = [None] * world
        dist.all_gather_object(dirs, sock_dir)
        store = dist.distributed_c10d._get_default_store()
        n = fd_passing._allgather_paths_store._call_count
        paths = [store.get(f"iris_fd_path_v{n}/{r}").decode() for r in range(world)]
        peer = 1 - rank
        pid, uid, _ = heap.peer_credentials(conns[peer])
        if rank == 1:
            r, w = os.pipe()
            os.write(w, b"a memory handle")
            os.close(w)
            fd_passing.send_fd(conns[0], r)
            os.close(r)
            got = None
        else:
            fd, _ = fd_passing.recv_fd(conns[1])
            got = os.read(fd, 100)
            os.close(fd)
        dist.barrier()
        for s in conns.values():
            s.close()
    return dict(dirs=dirs, paths=paths, peer_pid=pid, peer_uid=uid, pid=os.getpid(), got=got,
                left=os.path.exists(sock_dir), restored=fd_passing.make_rank_sock_path.__module__ == fd_passing.__name__)


def test_handles_pass_between_the_ranks_of_one_user(torch_group):
    res = torch_group(2).run(_exchange_task, timeout=120)
    for rank, r in enumerate(res):
        assert r["dirs"] == res[0]["dirs"] and len(set(r["dirs"])) == 2  # one private directory per rank
        # Every rank's listening socket was in that rank's private directory.
        assert all(os.path.dirname(p) == d for p, d in zip(r["paths"], r["dirs"]))
        assert r["peer_pid"] == res[1 - rank]["pid"] and r["peer_uid"] == os.geteuid()
        assert not r["left"] and r["restored"]
    assert res[0]["got"] == b"a memory handle"
