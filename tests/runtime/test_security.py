"""Issue 15 items 1, 5, 6, 7: one job per run dir, an authenticated control plane on loopback,
checkpoints loaded without unpickling code, a run dir only its owner can read. Issue 25 items 6
and 7: no link in the run dir is followed, no mode lets others write it, every file is 0600.

One launched job (``attacked``) is shared by several assertions: a client without the secret
forges "finished" and "promote" keys, copies a valid message under another key and replays an
old heartbeat while a real SIGKILL forces a recovery; a second launch into the same run dir is
refused; the store is not reachable on the machine's other addresses. Its final weights must be
bit-identical to an undisturbed run's.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from leto_lightning import cli
from leto_lightning.errors import ConfigurationError, LetoTimeoutError, UnsafeCheckpoint
from leto_lightning.examples import PLAIN_DDP
from leto_lightning.runtime import auth, rundir
from leto_lightning.runtime.control import SignedStore, host_store
from leto_lightning.runtime.events import EventLog, read_events
from leto_lightning.runtime.session import load_checkpoint_file
from leto_lightning.runtime.storage import PlantedLinkError, atomic_torch_save, run_dir_path

from .harness import finish, launch_args, run, same_state, start, stop, wait_for

ITERATIONS = 12
FAULT = {"id": 0, "rank": 1, "iteration": 7, "point": "chunk.math_done", "occurrence": 1, "wait_shadows": True}
SHARED_SECRET = "one-secret-for-two-jobs-" + os.urandom(8).hex()  # LETO_SECRET exported for both


def _client(port: int) -> dist.TCPStore:
    """Another process's view of the job's store: it knows the port, not the secret."""
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))


def _put(store, key: str, value) -> None:
    """``set`` is not acknowledged: read it back, so the write is in before the next step."""
    store.set(key, value)
    store.get(key)


def _live_agents_lock(run_dir) -> int:
    """A forked child that holds the run dir's lock (as a live agent does); returns its pid.
    The caller SIGKILLs and reaps it."""
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            rundir.claim(str(run_dir))
            os.write(ready_w, b"1")
            time.sleep(120)
        finally:
            os._exit(0)
    os.close(ready_w)
    try:
        assert os.read(ready_r, 1) == b"1"
    except BaseException:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise
    finally:
        os.close(ready_r)
    return pid


def _dead_agents_lock(run_dir) -> int:
    """A lock left by an agent that was SIGKILLed while holding it; returns the dead pid."""
    pid = _live_agents_lock(run_dir)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return pid


def _other_local_addresses() -> list[str]:
    """This machine's IPv4 addresses other than loopback (from the kernel's routing table)."""
    try:
        with open("/proc/net/fib_trie") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    found = {lines[i - 1].split()[-1] for i, line in enumerate(lines) if "/32 host LOCAL" in line and i}
    return sorted(a for a in found if not a.startswith("127."))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    result = run(tmp_path_factory.mktemp("reference"), ITERATIONS, extra=["--no-shadows"])  # shadows change nothing
    assert result.returncode == 0, result.output[-3000:]
    return result


@pytest.fixture(scope="module")
def attacked(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("attacked") / "run"
    dead = _dead_agents_lock(run_dir)
    os.environ["LETO_SECRET"] = SHARED_SECRET  # as a user who exports one secret for every job
    try:
        proc = start(run_dir, ITERATIONS, faults=[FAULT])
    finally:
        del os.environ["LETO_SECRET"]
    seen, second = {"dead_agent": dead}, None
    try:
        wait_for(lambda: any(e["event"] == "job_started" for e in read_events(run_dir)), 120, "job_started")
        (started,) = [e for e in read_events(run_dir) if e["event"] == "job_started"]
        seen["agent_pid"], port = started["pid"], started["port"]
        second = subprocess.Popen(launch_args(run_dir, ITERATIONS), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True)  # while the job surely still runs
        seen["listening"] = _listening_address(port)
        seen["other_hosts"] = {a: _reachable(a, port) for a in _other_local_addresses()}
        evil = _client(port)
        for key in ("finished/0/0", "finished/0/1", "finished/1/0", "finished/1/1"):
            evil.set(key, str(time.time()))  # an exit after "finished" is no failure: would end the job early
        # a genuine "promote" of another job sharing the secret: signed with the secret itself (what
        # any launch signed with before launch keys), then with another launch's key
        seen["replay_rejected_by"] = []
        for key in (SHARED_SECRET.encode(), auth.derive_job_key(SHARED_SECRET.encode(), "another-launch")):
            other_job = SignedStore(dist.HashStore(), key)
            before = len(_rejections(run_dir, "promote/0-0"))
            evil.set("promote/0-0", other_job.sign("promote/0-0", json.dumps({"generation": 0})))
            wait_for(lambda before=before: len(_rejections(run_dir, "promote/0-0")) >= before + 2, 60,
                     "both waiting shadows rejecting the replay")
            seen["replay_rejected_by"].append({e["reader"] for e in _rejections(run_dir, "promote/0-0")[before:]})
        evil.set("promote/0-0", json.dumps({"generation": 0}))  # shadows would train beside the actives
        seen["second"] = (second.communicate(timeout=120)[0], second.returncode)
        _replay_a_heartbeat(evil, run_dir)

        seen["result"] = finish(proc, run_dir)
    finally:
        stop(proc)
        if "second" not in seen and second is not None:
            stop(second)
    return seen


def _rejections(run_dir, key: str) -> list[dict]:
    return [e for e in read_events(run_dir) if e["event"] == "control_message_rejected" and e.get("key") == key]


def _replay_a_heartbeat(evil: dist.TCPStore, run_dir) -> None:
    """Write rank 0's older heartbeat back over a newer one the agent has read, and copy its newer
    one (valid, but signed for ``hb/0``) to ``hb/1``. Rank 0 is stopped meanwhile (rank 1 soon
    blocks in the all-reduce: nothing overwrites either); the newer value is put back until the
    agent has read it, then the older one again -- until the agent reports both."""
    while True:
        old = evil.get("hb/0")
        wait_for(lambda old=old: evil.get("hb/0") not in (old, b""), 120, "a newer heartbeat")
        newer = evil.get("hb/0")
        beat = newer.split(b".", 3)[3]  # the value after the signature
        if not beat:  # the agent's reset of a new trainer's heartbeat: wait for the trainer's own
            continue
        writer = json.loads(beat)["pid"]
        try:
            os.kill(writer, signal.SIGSTOP)
            break
        except ProcessLookupError:  # killed by a recovery meanwhile: the next writer
            continue
    try:
        deadline = time.time() + 60
        while not {"hb/0", "hb/1"} <= {e.get("key") for e in read_events(run_dir)
                                       if e["event"] == "control_message_rejected"}:
            assert time.time() < deadline, "the agent never read the replayed or the copied heartbeat"
            _put(evil, "hb/1", newer)
            _put(evil, "hb/0", newer)
            time.sleep(0.3)
            _put(evil, "hb/0", old)
            time.sleep(0.3)
        _put(evil, "hb/0", newer)
    finally:
        try:
            os.kill(writer, signal.SIGCONT)
        except ProcessLookupError:
            pass


def _listening_address(port: int) -> str:
    with open("/proc/net/tcp") as f:
        table = f.read().splitlines()[1:]
    for line in table:
        local, state = line.split()[1], line.split()[3]
        if state == "0A" and int(local.split(":")[1], 16) == port:
            return socket.inet_ntoa(bytes.fromhex(local.split(":")[0])[::-1])
    return "not found"


def _reachable(addr: str, port: int) -> bool:
    try:
        socket.create_connection((addr, port), timeout=2).close()
        return True
    except OSError:
        return False


def test_forged_and_replayed_control_messages_change_nothing(attacked, reference):
    result = attacked["result"]
    assert result.returncode == 0, result.output[-3000:]
    rejected = result.of("control_message_rejected")
    by_key = {(e["key"], e["reason"].split(":")[0]) for e in rejected}
    assert ("finished/0/1", "forged") in by_key, rejected  # the agent, when rank 1 was killed
    assert ("promote/0-0", "forged") in by_key, rejected  # the waiting shadows
    assert ("hb/0", "replayed") in by_key, rejected
    assert ("hb/1", "forged") in by_key, rejected  # rank 0's valid heartbeat, copied to rank 1's key
    assert any(e["reader"].endswith("shadow") for e in rejected if e["key"] == "promote/0-0")
    # another job's genuine promote (the same LETO_SECRET): rejected by both waiting shadows
    assert attacked["replay_rejected_by"] == [{"rank 0 shadow", "rank 1 shadow"}] * 2
    (done,) = [e for e in result.of("recovery_finished") if not e.get("interrupted")]
    assert done["promoted"] == "shadow"
    for rank in (0, 1):
        assert same_state(result.final(rank), reference.final(rank)) == []


def test_store_listens_on_loopback_only(attacked):
    assert attacked["listening"] == "127.0.0.1"
    assert not any(attacked["other_hosts"].values()), attacked["other_hosts"]


def test_a_second_launch_into_a_live_run_dir_is_refused(attacked):
    (output, code), result = attacked["second"], attacked["result"]
    assert code != 0 and "belongs to a live job" in output, output[-3000:]
    assert f"pid {attacked['agent_pid']}" in output
    assert "Traceback" not in output
    assert len(result.of("job_started")) == 1  # the refused launch wrote nothing
    (taken,) = result.of("run_dir_lock_taken_over")  # the stale lock of a dead agent
    assert taken["previous"]["pid"] == attacked["dead_agent"]


def test_run_dir_is_its_owners_alone(attacked):
    run_dir = attacked["result"].run_dir
    assert stat.S_IMODE(os.stat(run_dir).st_mode) == 0o700
    files = [os.path.join(d, f) for d, _, fs in os.walk(run_dir) for f in fs]
    assert any(f.endswith("events.jsonl") for f in files) and any("checkpoints" in f for f in files)
    modes = {f: oct(stat.S_IMODE(os.stat(f).st_mode)) for f in files}
    assert set(modes.values()) == {"0o600"}, modes
    assert not os.path.exists(run_dir / rundir.LOCK_FILE)  # released at the end
    # what the job's trainers saved loads under weights_only=True
    ckpt = load_checkpoint_file(str(run_dir / "checkpoints" / "it000000010" / "rank0.pt"))
    assert ckpt["iteration"] == 10


def test_a_live_lock_is_refused_and_a_dead_one_taken_over(tmp_path):
    pid = _live_agents_lock(tmp_path)
    try:
        with pytest.raises(rundir.RunDirBusy, match=f"pid {pid} "):
            rundir.claim(str(tmp_path))
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    claim = rundir.claim(str(tmp_path))
    try:
        assert claim.previous["pid"] == pid
    finally:
        claim.release()


def test_run_dir_mode_is_what_the_user_asks(tmp_path):
    path = tmp_path / "shared"
    claim = rundir.claim(str(path), rundir.parse_mode("0750"))
    try:
        open(path / "f", "w").close()
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o750
        assert stat.S_IMODE(os.stat(path / "f").st_mode) == 0o640
    finally:
        claim.release()
    with pytest.raises(ValueError, match="owner needs rwx"):
        rundir.parse_mode("0500")


@pytest.mark.parametrize("text", ["0777", "0770", "0730", "0702", "0757"])
def test_a_mode_that_lets_others_write_is_refused(tmp_path, text):
    """Issue 25 item 7: 0777 gave a 777 run dir and 666 files. Refused, naming the value and the fix,
    by the command line and by ``claim`` (a mode given in code), before anything is created."""
    with pytest.raises(ConfigurationError, match=f"--run-dir-mode '{text}' lets the group or others write .* use 0700"):
        rundir.parse_mode(text)
    umask = os.umask(0o022)
    os.umask(umask)
    with pytest.raises(ConfigurationError, match=f"'{text}' lets the group or others write"):
        rundir.claim(str(tmp_path / "run"), int(text, 8))
    assert not (tmp_path / "run").exists()
    assert os.umask(umask) == umask  # left as it was


def test_every_file_of_leto_train_is_the_owners_alone(tmp_path):
    """Issue 25 item 7: ``recipe.yaml`` was written 0644 (before the agent narrowed the umask).
    Under a login umask of 022, every file the agent and ``leto train`` write is 0600."""
    from leto_lightning.train import build_agent

    umask = os.umask(0o022)
    try:
        agent = build_agent("olmoe", ["size=tiny"], str(tmp_path / "run"))
        try:
            files = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "run") for f in fs]
            modes = {os.path.basename(f): oct(stat.S_IMODE(os.stat(f).st_mode)) for f in files}
        finally:
            agent.events.close()
            agent.run_dir_claim.release()
    finally:
        os.umask(umask)
    assert {"recipe.yaml", "events.jsonl", rundir.LOCK_FILE} <= set(modes), modes
    assert set(modes.values()) == {"0o600"}, modes


def _launch_refused(capsys, run_dir) -> str:
    """``leto launch`` into ``run_dir`` in this interpreter: the one line it printed (it must not
    start: a job that did would run one iteration and fail the caller's assertions)."""
    code = cli.main(["launch", "--run-dir", str(run_dir), "--nproc-per-node", "1", "--no-shadows", PLAIN_DDP,
                     "--iterations", "1"])
    out = capsys.readouterr()
    lines = [line for line in (out.err + out.out).splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in lines[0], (code, lines)
    return lines[0]


def test_links_planted_in_the_run_dir_are_refused_not_followed(tmp_path, capsys):
    """Issue 25 item 6: the agent appended its events to a file outside the run dir, checkpoints
    were written through a linked directory. Now the launch is refused in one line naming the link
    and the fix, and nothing is written where the links point."""
    victim, elsewhere = tmp_path / "victim.txt", tmp_path / "elsewhere"
    victim.write_text("mine\n")
    elsewhere.mkdir()
    for name, target in (("events.jsonl", victim), ("checkpoints", elsewhere), (rundir.LOCK_FILE, victim)):
        run_dir = tmp_path / f"run-{name}"
        run_dir.mkdir(mode=0o700)
        (run_dir / name).symlink_to(target)
        line = _launch_refused(capsys, run_dir)
        assert f"{run_dir / name} is a symbolic link (to {target})" in line and f"rm {run_dir / name}" in line, line
    assert victim.read_text() == "mine\n" and os.listdir(elsewhere) == []


def test_the_files_trainers_write_are_never_written_or_read_through_a_link(tmp_path):
    """What ``Session.save_checkpoint`` / ``load_checkpoint`` and the event log do, with links
    planted after the launch: a linked directory on the way, a link at the temporary file's
    (predictable) name, a link or a hard link in place of the file itself."""
    run, victim, elsewhere = tmp_path / "run", tmp_path / "victim.pt", tmp_path / "elsewhere"
    run.mkdir(mode=0o700)
    elsewhere.mkdir()
    victim.write_bytes(b"mine")
    (run / "checkpoints").symlink_to(elsewhere)
    with pytest.raises(PlantedLinkError, match="checkpoints is a symbolic link"):
        run_dir_path(str(run), "checkpoints", "rank0.pt")
    (run / "checkpoints").unlink()
    path = run_dir_path(str(run), "checkpoints", "rank0.pt")  # creates the directory, for real
    (run / "checkpoints" / f".rank0.pt.{os.getpid()}.tmp").symlink_to(victim)
    atomic_torch_save({"w": torch.ones(2)}, path)
    assert victim.read_bytes() == b"mine" and torch.equal(load_checkpoint_file(path)["w"], torch.ones(2))
    os.unlink(path)
    torch.save({"w": torch.zeros(2)}, elsewhere / "other.pt")
    os.symlink(elsewhere / "other.pt", path)
    with pytest.raises(PlantedLinkError, match="rank0.pt is a symbolic link"):
        run_dir_path(str(run), "checkpoints", "rank0.pt")
    with pytest.raises(PlantedLinkError, match="rank0.pt is a symbolic link"):
        load_checkpoint_file(path)
    (run / "events.jsonl").symlink_to(victim)
    with pytest.raises(PlantedLinkError, match="events.jsonl is a symbolic link"):
        EventLog(run)
    (run / "events.jsonl").unlink()
    os.link(victim, run / "events.jsonl")
    with pytest.raises(PlantedLinkError, match="events.jsonl has 2 names"):
        EventLog(run)
    assert victim.read_bytes() == b"mine"


@pytest.mark.skipif(os.geteuid() != 0, reason="planting a file of another uid needs root (chown)")
def test_an_entry_of_another_user_in_the_run_dir_is_refused(tmp_path):
    """Left while the run dir was writable to others: its owner could still change it."""
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True, mode=0o700)
    (run / "logs" / "loss.jsonl").write_text("")
    os.chown(run / "logs" / "loss.jsonl", 4242, 4242)
    with pytest.raises(PlantedLinkError, match=r"logs/loss\.jsonl in the run dir belongs to uid 4242"):
        rundir.claim(str(run))
    os.unlink(run / "logs" / "loss.jsonl")
    rundir.claim(str(run)).release()


def test_signed_store_rejects_forgery_copies_and_replays():
    raw, port = host_store("127.0.0.1", 0, timedelta(seconds=10))
    rejected = []
    agent = SignedStore(raw, b"s" * 32, on_reject=lambda k, why: rejected.append((k, why.split(":")[0])))
    trainer = SignedStore(_client(port), b"s" * 32)
    evil = _client(port)
    _put(evil, "promote/1", "{}")
    assert not agent.check(["promote/1"])  # forged: as if unset
    with pytest.raises(LetoTimeoutError, match="timeout"):  # by type: a store timeout, not a lost host
        agent.wait(["promote/1"], timedelta(seconds=0.3))
    trainer.set("promote/1", "go")
    agent.wait(["promote/1"], timedelta(seconds=5))
    assert agent.get("promote/1") == b"go"
    _put(evil, "finished/1", evil.get("promote/1"))  # valid, but signed for another key
    assert not agent.check(["finished/1"])
    _put(trainer, "hb", "1")
    old = evil.get("hb")
    assert agent.get("hb") == b"1"
    _put(trainer, "hb", "2")
    assert agent.get("hb") == b"2"
    _put(evil, "hb", old)  # replay: the last accepted value stands
    assert agent.get("hb") == b"2"
    _put(evil, "verdict", "forged")  # first writer wins -- but not a writer without the secret
    assert agent.compare_set("verdict", "", "mine") == b"mine"
    assert trainer.compare_set("verdict", "", "theirs") == b"mine"
    assert agent.add("count", 1) == 1 and trainer.add("count", 1) == 2 and agent.add("count", 0) == 2
    _put(evil, "count", "99")
    assert agent.add("count", 0) == 2
    assert rejected == [("promote/1", "forged"), ("finished/1", "forged"), ("hb", "replayed"),
                        ("verdict", "forged"), ("count", "forged")]
    del trainer, evil, agent, raw


def test_a_planted_pickle_is_refused_not_run(tmp_path):
    marker = tmp_path / "pwned"

    class Planted:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    path = tmp_path / "rank0.pt"
    torch.save({"model": Planted()}, path)
    with pytest.raises(UnsafeCheckpoint, match=r"rank0\.pt.*GLOBAL posix\.system"):
        load_checkpoint_file(str(path))
    assert not marker.exists()


def test_nodes_share_the_secret_or_stop_saying_how(tmp_path, monkeypatch):
    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    monkeypatch.delenv(auth.SECRET_FILE_ENV, raising=False)
    raw, port = host_store("127.0.0.1", 0, timedelta(seconds=10))
    node1 = _client(port)
    auth.write_secret_file(str(tmp_path), b"s" * 32)  # a stale secret of an earlier job
    mine = auth.job_secret(raw, 0, 2, str(tmp_path), None, timeout=5)  # node 0: a fresh one, to the run dir
    assert mine != b"s" * 32 and stat.S_IMODE(os.stat(tmp_path / auth.SECRET_FILE).st_mode) == 0o600
    assert auth.job_secret(node1, 1, 2, str(tmp_path), None, timeout=5) == mine  # read from the shared run dir
    monkeypatch.setenv(auth.SECRET_ENV, "another-secret-of-20")  # node 1 was given a different one
    with pytest.raises(LetoTimeoutError, match="differs from node 0's"):
        auth.job_secret(node1, 1, 2, str(tmp_path), None, timeout=0.3)
    elsewhere = tmp_path / "node1-own-run-dir"  # node 1 not on the shared filesystem, no secret given
    elsewhere.mkdir()
    monkeypatch.delenv(auth.SECRET_ENV)
    monkeypatch.setattr(auth, "SHARED_FILE_GRACE_S", 0.5)
    started = time.monotonic()
    with pytest.raises(LetoTimeoutError, match="no matching job.secret"):  # at once after the grace,
        auth.job_secret(node1, 1, 2, str(elsewhere), None, timeout=600)  # not at the start-up timeout
    assert time.monotonic() - started < 60
    monkeypatch.setenv(auth.SECRET_ENV, "short")
    with pytest.raises(ValueError, match="at least 16"):
        auth.job_secret(node1, 1, 2, str(tmp_path), None, timeout=0.3)
    secret_file = tmp_path / "given.secret"
    secret_file.write_text("a-secret-in-a-file-0123\n")
    secret_file.chmod(0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        auth.user_secret(str(secret_file))
    secret_file.chmod(0o600)
    assert auth.user_secret(str(secret_file)) == b"a-secret-in-a-file-0123"
    del node1, raw


class _Planted:
    """Unpickling this runs a shell command (what a planted checkpoint would do)."""

    def __init__(self, marker) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.skipif(not os.environ.get("LETO_LONG"), reason="a whole launched job (~1 min on 2 cores): LETO_LONG=1")
def test_a_planted_checkpoint_is_not_run_on_a_restart(tmp_path):
    """The trainers' real restart path: a non-HOF exit before any checkpoint of this job makes the
    agent restart from ``checkpoints/it000000000/rank0.pt`` -- a planted pickle, marked committed.
    Nothing runs; the job stops with the refusal as its reason."""
    run_dir, marker = tmp_path / "run", tmp_path / "pwned"
    planted = run_dir / "checkpoints" / "it000000000"
    planted.mkdir(parents=True, mode=0o700)
    torch.save({"model": _Planted(marker)}, planted / "rank0.pt")
    (planted / "COMMITTED").write_text("0\n")
    fault = {"id": 0, "rank": 0, "iteration": 0, "point": "compute.begin", "action": "exit", "code": 17}
    result = run(run_dir, 3, faults=[fault], nproc=1, extra=["--no-shadows", "--non-hof-exit-code", "17"])
    assert not marker.exists()
    (stopped,) = result.of("job_stopped")
    assert result.returncode == 3 and "UnsafeCheckpoint" in stopped["reason"], stopped


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def _wait_started(run_dir) -> dict:
    wait_for(lambda: any(e["event"] == "job_started" for e in read_events(run_dir)), 120, "job_started")
    return next(e for e in read_events(run_dir) if e["event"] == "job_started")


def test_a_deleted_key_and_a_flood_of_forged_values_change_nothing(tmp_path, reference):
    """Another local user deletes ``shadows/ready`` again and again and writes 200 distinct 7 MB
    forged values there, while a real SIGKILL forces a recovery: the agent never blocks on the key
    (a ``control_key_missing`` event, the loop goes on), keeps none of the values (its resident
    memory stays within 150 MiB of what it was), and the job ends bit-identical."""
    run_dir = tmp_path / "run"
    proc = start(run_dir, ITERATIONS, faults=[FAULT], script_args=["--sleep", "0.3"])
    try:
        started = _wait_started(run_dir)
        evil, agent = _client(started["port"]), started["pid"]
        wait_for(lambda: evil.check(["shadows/ready"]), 60, "the agent's shadows/ready key")
        before = _rss_mib(agent)
        evil.delete_key("shadows/ready")
        wait_for(lambda: any(e["event"] == "control_key_missing" for e in read_events(run_dir)), 30,
                 "the missing key on record")
        peak = before
        for n in range(200):
            evil.set("shadows/ready", os.urandom(8).hex().encode() + b"." * (7 << 20))
            if n % 20 == 0:
                evil.delete_key("shadows/ready")
                peak = max(peak, _rss_mib(agent))
        time.sleep(1.0)
        peak = max(peak, _rss_mib(agent))

        result = finish(proc, run_dir)
    finally:
        stop(proc)
    assert result.returncode == 0, result.output[-3000:]
    assert peak - before < 150, (before, peak)
    assert any(e["key"] == "shadows/ready" for e in result.of("control_key_missing"))
    assert any(e["reason"].startswith("oversize") for e in result.of("control_message_rejected"))
    assert [e["promoted"] for e in result.of("recovery_finished") if not e.get("interrupted")] == ["shadow"]
    for rank in (0, 1):
        assert same_state(result.final(rank), reference.final(rank)) == []


def test_sigterm_wins_while_a_control_key_is_withheld(tmp_path):
    """The key the agent reads every poll is deleted as fast as the agent writes it back; a
    SIGTERM to the launcher still stops the job, every process ended, well before any store
    timeout (60 s) could have freed the agent."""
    run_dir = tmp_path / "run"
    proc = start(run_dir, 400, script_args=["--sleep", "0.2"])
    try:
        started = _wait_started(run_dir)
        evil = _client(started["port"])
        wait_for(lambda: os.path.exists(run_dir / "loss_rank0.jsonl"), 120, "training to start")
        for _ in range(50):
            evil.delete_key("shadows/ready")
            time.sleep(0.02)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        while proc.poll() is None and time.monotonic() - t0 < 60:
            try:
                evil.delete_key("shadows/ready")
            except dist.DistNetworkError:  # the agent closed the job's store: it is stopping
                pass
            time.sleep(0.02)
        elapsed = time.monotonic() - t0

        result = finish(proc, run_dir)
    finally:
        stop(proc)
    assert elapsed < 30, elapsed  # blocked on the key, it would wait out the 60 s store timeout
    assert result.returncode == 128 + signal.SIGTERM and result.of("job_interrupted")
