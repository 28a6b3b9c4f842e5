"""Namespace sandboxes on a node: a per-node daemon that starts each sandbox as Linux namespaces over a
read-only image root, and the small commands the controller runs to reach it. Standard library only; runs
on the node's own python3 (3.8+) as root, shipped over the node channel like the exec agent.

Started as ``python3 -S -I -c BOOTSTRAP MODE ARGS`` with ``b"%d\\n" % len(src) + src`` on stdin:

- ``ensure STATE_DIR``: make sure this version's daemon serves ``STATE_DIR/nsd-VERSION.sock`` (daemons of
  other versions keep serving their own sandboxes, and exit once idle); print ``{"socket", "version", "pid"}``.
- ``call SOCKET``: send the JSON request that follows the source on stdin, print the JSON reply.
- ``attach SOCKET REQUEST``: hand this process's stdin and stdout to the daemon as a new sandbox's channel
  (the SSH path; a local controller passes a socket instead), then wait as ``tail --pid`` until the sandbox
  ends (sshd closes a channel whose process exited); a launch failure is written to stdout as an
  exec-agent error frame.
- ``unpack STATE_DIR SHA256``: extract the rootfs tarball that follows on stdin into STATE_DIR/rootfs/SHA256
  (for nodes without Podman), refusing unsafe members by name and a content that does not match.
- ``check``: what this host supports, as JSON (no daemon needed).

The daemon (one per node and version, not per sandbox) answers one JSON line per connection on its unix
socket: ``ping``, ``launch`` (with the channel's fds passed as SCM_RIGHTS; answered once the sandbox has set
itself up, while other requests and launches go on), ``list``, ``remove`` (answered once the sandboxes are
gone and cleaned up), ``retire``. It is every sandbox's parent (a child subreaper), reaps them, and removes
each one's cgroups, scratch directory and record when it dies, whoever killed it.

A sandbox is: new mount, PID, IPC, UTS and (unless ``network``) network namespaces; an overlay whose
lower layers are the image's read-only layer directories and whose upper is on the node's disk (or a
sized tmpfs) as its root, entered with ``pivot_root`` and the old root detached; a private /proc (kernel
files masked or read-only), read-only /sys, a minimal /dev (null zero full random urandom tty, its own
devpts and /dev/shm); memory, pids and CPU limits in its own cgroups (v1 or v2, whichever the node has for
each controller), visible read-only under /sys/fs/cgroup; Podman's default capability bounding set,
``no_new_privs``. Its first process (PID 1 inside) is the exec agent itself, run by this interpreter on
the inherited channel: nothing of the sandbox lives outside its namespaces, and one SIGKILL to that
process ends everything in it. Last, where the request asks for it, PID 1 unshares a user namespace whose
identity id maps the first child writes: files and users keep their ids, but every other namespace and
mount of the sandbox belongs to the node's user namespace, so no capability inside reaches them. No
seccomp filter (Podman has one): kernel attack surface is out of scope.
"""

import array
import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import hashlib
import io
import json
import os
import platform
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time

# Runs as `python3 -S -I -c BOOTSTRAP MODE ...`: read this file's source from stdin and run it.
BOOTSTRAP = (
    "import sys\n"
    "n = int(sys.stdin.buffer.readline())\n"
    "src = sys.stdin.buffer.read(n)\n"
    "exec(compile(src, 'swectl_nsbox.py', 'exec'), {'__name__': '__swectl_nsbox__', '__nsbox_source__': src})\n"
)

LATE_RECLAIM_S = 3.0  # the second look for a dead daemon's sandboxes, after start
DAEMON_GONE_EXIT = 75  # `call` / `attach` on a node whose daemon does not answer (the controller restarts it)
DAEMON_GONE_MARK = "nsbox daemon gone"  # begins the error an `attach` reports in the sandbox's channel then
TRASH_SWEEP_S = 10.0  # how often a scratch folder left being removed (``*.removing``, no record) is removed again
IDLE_EXIT_S = 900.0  # a daemon with no sandboxes for this long exits (the next `ensure` starts it again)
MAX_REQUEST = 1 << 20
SETUP_TIMEOUT_S = 30.0
CONTROLLERS = ("memory", "pids", "cpu")
CGROUP_GROUP = "swectl-ns"
CPU_PERIOD_US = 100_000

# Podman's default capability set (containers.conf `default_capabilities`); all others leave the bounding set.
KEEP_CAPS = {
    0: "CHOWN", 1: "DAC_OVERRIDE", 3: "FOWNER", 4: "FSETID", 5: "KILL", 6: "SETGID", 7: "SETUID",
    8: "SETPCAP", 10: "NET_BIND_SERVICE", 18: "SYS_CHROOT", 31: "SETFCAP",
}  # fmt: skip

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWPID, CLONE_NEWNET, CLONE_NEWUSER = 0x20000000, 0x40000000, 0x10000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_CHILD_SUBREAPER, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 36, 24, 38
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
LINUX_CAPABILITY_VERSION_3 = 0x20080522
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
SIOCADDRT, RTF_UP = 0x890B, 0x1
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}.get(platform.machine(), 155)
SYS_CAPSET = {"x86_64": 126, "aarch64": 91}.get(platform.machine(), 126)

MASKED_PROC = ("kcore", "keys", "timer_list", "sched_debug", "latency_stats", "acpi", "scsi")
READONLY_PROC = ("sys", "sysrq-trigger", "irq", "bus", "fs")
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


class SetupError(Exception):
    """A sandbox could not be set up: the message says which step."""


def _check(result: int, what: str) -> int:
    if result == -1:
        code = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(code)} (errno {code})")
    return result


def _mount(source, target, fstype, flags=0, data=None, what=""):
    _check(
        _libc.mount(
            None if source is None else os.fsencode(source), os.fsencode(target),
            None if fstype is None else os.fsencode(fstype), ctypes.c_ulong(flags),
            None if data is None else os.fsencode(data),
        ),
        what or f"mount {fstype or source} on {target}",
    )


def _bind_readonly(source, target, flags=0):
    _mount(source, target, None, MS_BIND | MS_REC, what=f"bind {source} on {target}")
    _mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | flags, what=f"remount {target} read-only")


# ------------------------------------------------------------------------------------------- host facts


def cgroup_mounts():
    """{controller: (version, mountpoint)} for the controllers swectl limits, from /proc/self/mountinfo."""
    found, v2_root = {}, None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            pre, _, post = line.partition(" - ")
            fields, extra = pre.split(), post.split()
            if len(extra) < 3:
                continue
            fstype, options, mountpoint = extra[0], extra[2].split(","), fields[4]
            if fstype == "cgroup":
                for controller in CONTROLLERS:
                    if controller in options and controller not in found:
                        found[controller] = (1, mountpoint)
            elif fstype == "cgroup2" and v2_root is None:
                v2_root = mountpoint
    if v2_root is not None:
        try:
            with open(os.path.join(v2_root, "cgroup.controllers")) as f:
                available = f.read().split()
        except OSError:
            available = []
        for controller in CONTROLLERS:
            if controller not in found and controller in available:
                found[controller] = (2, v2_root)
    return found


def check_host():
    """What this host offers the namespace backend: {"ok", "problems", "limits", ...}."""
    problems = []
    if os.geteuid() != 0:
        problems.append("not root: namespace sandboxes need root on the node (mounts, namespaces, cgroups)")
    try:
        with open("/proc/filesystems") as f:
            filesystems = f.read().split()
    except OSError:
        filesystems = []
    if "overlay" not in filesystems:
        problems.append("the kernel has no overlay filesystem (modprobe overlay)")
    for name in ("mnt", "pid", "net", "ipc", "uts"):
        if not os.path.exists(f"/proc/self/ns/{name}"):
            problems.append(f"the kernel has no {name} namespaces")
    limits = cgroup_mounts()
    missing = [c for c in CONTROLLERS if c not in limits]
    userns = "unknown"
    with contextlib.suppress(OSError):
        with open("/proc/sys/user/max_user_namespaces") as f:
            userns = "yes" if int(f.read()) > 0 else "no"
    return {
        "ok": not problems,
        "problems": problems,
        "limits": {c: f"cgroup v{v} at {m}" for c, (v, m) in limits.items()},
        "unenforced_limits": missing,
        "user_namespaces": userns,
        "kernel": platform.release(),
        "python": platform.python_version(),
    }


def _starttime(pid):
    """The process's start time in clock ticks (tells a pid from its reuse), or None if it is gone (a zombie, or
    dying: a daemon killed a moment ago no longer owns its sandboxes)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return None if fields[0] in ("Z", "X", "x") else int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


# ---------------------------------------------------------------------------------- one sandbox's setup


class Box:
    """One sandbox as the daemon keeps it: its request, host pid and host-side paths."""

    def __init__(self, request, state_dir):
        self.request = request
        self.id = request["id"]
        self.dir = os.path.join(state_dir, "boxes", self.id)
        self.record = os.path.join(state_dir, "boxes", self.id + ".json")
        self.cgroups = {}  # controller -> cgroup directory
        self.pid = 0
        self.starttime = None
        self.state = "creating"
        self.doomed = False  # a remove came while it was starting
        self.daemon = None  # [pid, starttime] of the daemon that started it

    def describe(self):
        r = self.request
        return {
            "id": self.id, "name": r.get("name", self.id), "image": r.get("image", ""),
            "labels": r.get("labels", {}), "state": self.state, "pid": self.pid,
        }

    def save(self):
        data = {**self.describe(), "starttime": self.starttime, "cgroups": self.cgroups, "dir": self.dir,
                "daemon": self.daemon}  # fmt: skip
        tmp = self.record + ".tmp"
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, self.record)


def _write(path, value):
    with open(path, "w") as f:
        f.write(value)


def make_cgroups(box, mounts):
    """Create the sandbox's cgroups with its limits; {controller: dir}. Missing controllers are skipped."""
    r = box.request
    made = {}
    for controller in CONTROLLERS:
        if controller not in mounts:
            continue
        version, root = mounts[controller]
        parent = os.path.join(root, CGROUP_GROUP)
        os.makedirs(parent, exist_ok=True)
        if version == 2:
            with contextlib.suppress(OSError):
                _write(os.path.join(root, "cgroup.subtree_control"), f"+{controller}")
            with contextlib.suppress(OSError):
                _write(os.path.join(parent, "cgroup.subtree_control"), f"+{controller}")
        path = os.path.join(parent, box.id)
        os.makedirs(path, exist_ok=True)
        made[controller] = path
        if controller == "memory" and r.get("memory_bytes"):
            limit = str(int(r["memory_bytes"]))
            if version == 1:
                _write(os.path.join(path, "memory.limit_in_bytes"), limit)
                with contextlib.suppress(OSError):  # without swap accounting the file is absent
                    _write(os.path.join(path, "memory.memsw.limit_in_bytes"), limit)
            else:
                _write(os.path.join(path, "memory.max"), limit)
                with contextlib.suppress(OSError):
                    _write(os.path.join(path, "memory.swap.max"), "0")
        elif controller == "pids" and r.get("pids"):
            _write(os.path.join(path, "pids.max"), str(int(r["pids"])))
        elif controller == "cpu" and r.get("cpus"):
            quota = max(1000, int(float(r["cpus"]) * CPU_PERIOD_US))
            if version == 1:
                _write(os.path.join(path, "cpu.cfs_period_us"), str(CPU_PERIOD_US))
                _write(os.path.join(path, "cpu.cfs_quota_us"), str(quota))
            else:
                _write(os.path.join(path, "cpu.max"), f"{quota} {CPU_PERIOD_US}")
    return made


def _remove_cgroup(path):
    for _ in range(50):
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                return
            time.sleep(0.01)


def _lower_option(layers):
    """Overlay's lowerdir, with podman's short layer links (``l/ID``) when they exist: mount options are
    limited to one page, and a deep image's full paths do not fit. Returns (option, directory to chdir to)."""
    if not layers:
        raise SetupError("no image layers")
    short, base = [], None
    for layer in layers:
        layer_dir = os.path.dirname(layer.rstrip("/"))
        try:
            with open(os.path.join(layer_dir, "link")) as f:
                link = f.read().strip()
        except OSError:
            short = None
            break
        here = os.path.dirname(layer_dir)
        if base not in (None, here) or not link:
            short = None
            break
        base = here
        short.append(f"l/{link}")
    if short and os.path.isdir(os.path.join(base, "l")):
        return ":".join(short), base
    return ":".join(layers), "/"


def _drop_privileges():
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last = int(f.read())
    for cap in range(last + 1):
        if cap not in KEEP_CAPS:
            _check(_libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), f"dropping capability {cap} from the bounding set")
    keep = 0
    for cap in KEEP_CAPS:
        keep |= 1 << cap
    header = struct.pack("=Ii", LINUX_CAPABILITY_VERSION_3, 0)
    low, high = keep & 0xFFFFFFFF, keep >> 32
    data = struct.pack("=6I", low, low, 0, high, high, 0)  # effective, permitted, inheritable per word
    hbuf, dbuf = ctypes.create_string_buffer(header), ctypes.create_string_buffer(data)
    _check(_libc.syscall(SYS_CAPSET, hbuf, dbuf), "capset")
    _libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")


class _RtEntry(ctypes.Structure):
    """The kernel's ``struct rtentry`` (SIOCADDRT): sockaddrs as 16 raw bytes, padding named as there."""

    _fields_ = [
        ("rt_pad1", ctypes.c_ulong),
        ("rt_dst", ctypes.c_ubyte * 16),
        ("rt_gateway", ctypes.c_ubyte * 16),
        ("rt_genmask", ctypes.c_ubyte * 16),
        ("rt_flags", ctypes.c_ushort),
        ("rt_pad2", ctypes.c_short),
        ("rt_pad3", ctypes.c_ulong),
        ("rt_pad4", ctypes.c_void_p),
        ("rt_metric", ctypes.c_short),
        ("rt_dev", ctypes.c_char_p),
        ("rt_mtu", ctypes.c_ulong),
        ("rt_window", ctypes.c_ulong),
        ("rt_irtt", ctypes.c_ushort),
    ]


def _loopback_up():
    """Bring ``lo`` up and route every other IPv4 address into it. A packet for an address off the sandbox
    then loops back and is dropped (forwarding is off), so a connect to it times out, as it does behind a
    firewall, instead of failing at once with "Network is unreachable": tests that expect a connect timeout
    from an unroutable address (requests' 10.255.255.1) pass as they do in the official, networked
    containers. Nothing leaves the sandbox either way."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifr = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, ifr))[1]
        fcntl.ioctl(s.fileno(), SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))
        route = _RtEntry(rt_flags=RTF_UP, rt_dev=b"lo")
        any_address = struct.pack("=H14x", socket.AF_INET)  # 0.0.0.0, for the destination and its mask
        ctypes.memmove(route.rt_dst, any_address, 16)
        ctypes.memmove(route.rt_genmask, any_address, 16)
        _check(_libc.ioctl(s.fileno(), SIOCADDRT, ctypes.byref(route)), "routing off-sandbox addresses into lo")


def _mkdirs(path):
    with contextlib.suppress(FileExistsError):
        os.makedirs(path)


def _touch(path):
    if not os.path.exists(path):
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o644))


def sandbox_hostname(box):
    """The sandbox's hostname: the request's, else the first 12 characters of its id (as Podman names one)."""
    return box.request.get("hostname") or box.id[:12]


def write_name_files(root, hostname, network):
    """What Podman writes into every container: /etc/hosts (the image's lines, with ``localhost`` and the
    hostname added where missing), /etc/hostname and, with the node's network, the node's /etc/resolv.conf.
    Without /etc/hosts nothing resolves ``localhost`` (tests that bind a server to it fail). Without the
    network, a resolv.conf naming 127.0.0.1, where nothing answers: a name lookup fails at once rather than
    waiting out a nameserver that the sandbox's routes lead into ``lo``. An /etc that is
    a symlink is left alone, and a file that is a symlink is replaced: nothing is written outside the root."""
    etc = os.path.join(root, "etc")
    if os.path.islink(etc) or not os.path.isdir(etc):
        return

    def replace(name, text):
        path = os.path.join(etc, name)
        if os.path.islink(path):
            os.unlink(path)
        _write(path, text)

    hosts = os.path.join(etc, "hosts")
    lines = []
    if os.path.isfile(hosts) and not os.path.islink(hosts):
        with open(hosts, errors="replace") as f:
            lines = f.read().splitlines()
    names = {name for line in lines for name in line.split("#")[0].split()[1:]}
    added = [] if "localhost" in names else ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
    if hostname not in names:
        added.append(f"127.0.0.1\t{hostname}")
    if added:  # always when the image has no /etc/hosts (nothing names localhost)
        replace("hosts", "\n".join([*added, *lines, ""]))
    replace("hostname", hostname + "\n")
    if not network:
        replace("resolv.conf", "# no network in this sandbox: lookups fail at once\nnameserver 127.0.0.1\n")
    elif os.path.isfile("/etc/resolv.conf"):
        with open("/etc/resolv.conf", errors="replace") as f:
            replace("resolv.conf", f.read())


def setup_root(box):
    """In the sandbox's new mount namespace, as its PID 1: build its root and enter it."""
    r = box.request
    _check(_libc.unshare(CLONE_NEWNS), "unshare(mount namespace)")
    _mount(None, "/", None, MS_REC | MS_PRIVATE, what="making mounts private")
    if not r.get("network") and r.get("userns"):
        # the sandbox's own network namespace belongs to the node's user namespace, so binding a port below
        # 1024 would need a capability it cannot have there: let every port be bound, as rootless Podman does
        with contextlib.suppress(OSError):
            _write("/proc/sys/net/ipv4/ip_unprivileged_port_start", "0")
    scratch = box.dir
    if r.get("upper") == "tmpfs":
        scratch = os.path.join(box.dir, "rw")
        _mkdirs(scratch)
        _mount("tmpfs", scratch, "tmpfs", MS_NOSUID | MS_NODEV, f"size={int(r['upper_size'])},mode=755")
    upper, work, root = (os.path.join(scratch, d) for d in ("upper", "work", "root"))
    for d in (upper, work, root):
        _mkdirs(d)
    lower, base = _lower_option(r["layers"])
    for layer in r["layers"]:
        if not os.path.isdir(layer):
            raise SetupError(f"image layer {layer} is gone (image removed?)")
    os.chdir(base)
    _mount("overlay", root, "overlay", 0, f"lowerdir={lower},upperdir={upper},workdir={work}",
           what="mounting the overlay root")  # fmt: skip
    os.chdir(root)
    for d in ("proc", "sys", "dev", "tmp", ".swectl-oldroot", r.get("workdir", "/").lstrip("/")):
        if d:
            _mkdirs(os.path.join(root, d))
    if os.stat(os.path.join(root, "tmp")).st_mode & 0o7777 != 0o1777:
        os.chmod(os.path.join(root, "tmp"), 0o1777)
    write_name_files(root, sandbox_hostname(box), r.get("network"))
    for source, target in r.get("mounts") or ():  # the node's folders, read-only (a CLI agent's tools)
        if not os.path.isdir(source):
            raise SetupError(f"mount source {source} is not a folder on the node")
        inside = os.path.join(root, target.lstrip("/"))
        _mkdirs(inside)
        _bind_readonly(source, inside, MS_NOSUID | MS_NODEV)
    proc = os.path.join(root, "proc")
    _mount("proc", proc, "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    sysfs = os.path.join(root, "sys")
    _mount("sysfs", sysfs, "sysfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
    cgroup_root = os.path.join(sysfs, "fs", "cgroup")
    if os.path.isdir(cgroup_root) and box.cgroups:
        _mount("tmpfs", cgroup_root, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=755,size=64k")
        for controller, path in box.cgroups.items():
            target = os.path.join(cgroup_root, controller)
            _mkdirs(target)
            _bind_readonly(path, target, MS_NOSUID | MS_NODEV | MS_NOEXEC)
        _mount(None, cgroup_root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
               what="remounting /sys/fs/cgroup read-only")  # fmt: skip
    dev = os.path.join(root, "dev")
    _mount("tmpfs", dev, "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=755,size=64k")
    for name in DEVICES:
        target = os.path.join(dev, name)
        _touch(target)
        _mount(f"/dev/{name}", target, None, MS_BIND)
    for name, link in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                       ("stderr", "/proc/self/fd/2"), ("ptmx", "pts/ptmx")):  # fmt: skip
        os.symlink(link, os.path.join(dev, name))
    for name in ("pts", "shm"):
        _mkdirs(os.path.join(dev, name))
    _mount("devpts", os.path.join(dev, "pts"), "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=620")
    _mount("shm", os.path.join(dev, "shm"), "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=1777,size=64m")
    _mount(None, dev, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NOEXEC, what="remounting /dev read-only")
    for name in MASKED_PROC:
        target = os.path.join(proc, name)
        if os.path.isdir(target):
            _mount("tmpfs", target, "tmpfs", MS_RDONLY, "size=0")
        elif os.path.exists(target):
            _mount("/dev/null", target, None, MS_BIND)
    for name in READONLY_PROC:
        target = os.path.join(proc, name)
        if os.path.exists(target):
            _bind_readonly(target, target)
    _check(_libc.syscall(SYS_PIVOT_ROOT, b".", b".swectl-oldroot"), "pivot_root")
    os.chdir("/")
    _check(_libc.umount2(b"/.swectl-oldroot", MNT_DETACH), "detaching the old root")
    os.rmdir("/.swectl-oldroot")


def _enter_user_namespace(userns):
    """Unshare a user namespace as the last step of the setup; the first child (still in the node's user
    namespace) writes its identity id maps. Every namespace and mount of the sandbox was made before, so they
    belong to the node's user namespace: whatever capability a process of the sandbox holds, it holds over
    nothing but its own user namespace (no mount, network, hostname or kernel setting is within reach)."""
    unshared_w, mapped_r = userns
    _check(_libc.unshare(CLONE_NEWUSER), "unshare(user namespace)")
    os.write(unshared_w, b"u")
    os.close(unshared_w)
    answer = os.read(mapped_r, 1)
    os.close(mapped_r)
    if answer != b"1":
        raise SetupError("the user namespace's id maps could not be written")


def _map_identity(pid):
    """Identity uid/gid maps: files and users keep their ids, inside and outside."""
    for name in ("uid_map", "gid_map"):
        _write(f"/proc/{pid}/{name}", "0 0 4294967295\n")


def run_sandbox(box, channel_fds, status_w, agent_code, userns=None):
    """PID 1 of a new sandbox: set it up, report, become the exec agent. Never returns."""
    r = box.request
    try:
        setup_root(box)
        name = sandbox_hostname(box)
        _check(_libc.sethostname(name.encode(), len(name.encode())), "sethostname")
        if not r.get("network"):
            _loopback_up()
        if userns is not None:
            _enter_user_namespace(userns)
        stdin_fd, stdout_fd = channel_fds[0], channel_fds[-1]
        os.dup2(stdin_fd, 0)
        os.dup2(stdout_fd, 1)
        null = os.open("/dev/null", os.O_RDWR)
        os.dup2(null, 2)
        os.closerange(3, status_w)
        os.closerange(status_w + 1, 65536)
        os.environ.clear()
        os.environ.update(r.get("env", {}))
        os.environ["HOSTNAME"] = name
        workdir = r.get("workdir") or "/"
        os.chdir(workdir if os.path.isdir(workdir) else "/")
        _drop_privileges()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL)
        signal.set_wakeup_fd(-1)
        os.write(status_w, b"ok\n")
        os.close(status_w)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.write(status_w, f"error {exc}\n".encode(errors="replace")[:4000])
        os._exit(1)
    try:
        sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "rb", closefd=False)), encoding="utf-8")
        exec(agent_code, {"__name__": "__swectl_agent__"})
    finally:
        os._exit(0)


def start_launch(box, channel_fds, agent_code, mounts):
    """Fork the sandbox (daemon side): returns the read end of its status pipe. The first child joins the
    cgroups, unshares and forks PID 1 of the sandbox, reports its pid and exits; PID 1 reports ``ok`` or
    ``error ...`` once set up. ``finish_launch`` reads the report."""
    os.makedirs(box.dir, exist_ok=True)
    box.cgroups = make_cgroups(box, mounts)
    status_r, status_w = os.pipe()
    # No CLONE_NEWNS here: PID 1 makes its own mount namespace, so that its pivot_root leaves the first child
    # (which writes the user namespace's id maps through the node's /proc) where it was.
    flags = CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
    if not box.request.get("network"):
        flags |= CLONE_NEWNET
    first = os.fork()
    if first == 0:
        try:
            os.close(status_r)
            for path in box.cgroups.values():
                _write(os.path.join(path, "cgroup.procs"), str(os.getpid()))
            _check(_libc.unshare(flags), "unshare")
            userns = box.request.get("userns")
            if userns:
                unshared_r, unshared_w = os.pipe()
                mapped_r, mapped_w = os.pipe()
            pid = os.fork()
            if pid == 0:
                if userns:
                    os.close(unshared_r)
                    os.close(mapped_w)
                run_sandbox(box, channel_fds, status_w, agent_code, (unshared_w, mapped_r) if userns else None)
            os.write(status_w, f"pid {pid}\n".encode())
            if userns:  # wait for the sandbox to unshare its user namespace, then map its ids
                os.close(unshared_w)
                os.close(mapped_r)
                if os.read(unshared_r, 1) == b"u":
                    try:
                        _map_identity(pid)
                        os.write(mapped_w, b"1")
                    except OSError as exc:
                        os.write(status_w, f"error writing the user namespace's id maps: {exc}\n".encode())
                        os.write(mapped_w, b"0")
            os._exit(0)
        except BaseException as exc:
            with contextlib.suppress(OSError):
                os.write(status_w, f"error {exc}\n".encode(errors="replace")[:4000])
            os._exit(1)
    os.close(status_w)
    os.set_blocking(status_r, False)
    return status_r


def finish_launch(box, report):
    """Parse a launch's status report (``pid N``, then ``ok`` or ``error ...``); returns the host pid of the
    sandbox's PID 1 or raises SetupError (after killing what was started)."""
    lines = report.decode(errors="replace").splitlines()
    pid = next((int(line.split()[1]) for line in lines if line.startswith("pid ")), 0)
    box.pid = pid
    box.starttime = _starttime(pid) if pid else None
    errors = [line[6:] for line in lines if line.startswith("error ")]
    if errors or "ok" not in lines:
        if pid:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        raise SetupError("; ".join(errors) or f"sandbox setup did not finish within {SETUP_TIMEOUT_S:.0f}s")
    return pid


# ------------------------------------------------------------------------------------------------ daemon


class Launch:
    """A launch in progress: its request's connection, the sandbox, the status pipe and what it said."""

    def __init__(self, conn, box, status_r, fds):
        self.conn = conn
        self.box = box
        self.status_r = status_r
        self.fds = fds
        self.report = b""
        self.deadline = time.monotonic() + SETUP_TIMEOUT_S


class Daemon:
    """The node's namespace-sandbox daemon: a single-threaded loop over its socket, SIGCHLD and the status
    pipes of launches in progress (sandboxes set themselves up in parallel; the loop never waits on one)."""

    def __init__(self, state_dir, version, agent_source, socket_path):
        self.state_dir = state_dir
        self.version = version
        self.socket_path = socket_path
        self.agent_code = compile(agent_source, "swectl_exec_agent.py", "exec")  # once, not per sandbox
        self.identity = [os.getpid(), _starttime(os.getpid())]
        self.boxes = {}  # id -> Box
        self.by_pid = {}  # host pid -> Box
        self.launches = {}  # status pipe fd -> Launch
        self.waiting = []  # (conn, ids) of remove requests answered once those sandboxes are gone
        # pid of an `rm -rf` -> (the folder it removes, the Box it cleans up after or None for a sweep of old trash)
        self.cleaners = {}
        self.retiring = False
        self.idle_since = time.monotonic()
        self.mounts = cgroup_mounts()
        self.selector = selectors.DefaultSelector()

    def serve(self, listener):
        _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        os.set_blocking(wake_r, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGTERM, lambda *_: self.retire())
        self.selector.register(listener, selectors.EVENT_READ, "accept")
        self.selector.register(wake_r, selectors.EVENT_READ, "signal")
        self.reclaim_stale()
        # once more a little later: a daemon started just after the last one was killed may have found it still
        # exiting, and left its sandboxes alone
        late_reclaim = time.monotonic() + LATE_RECLAIM_S
        next_sweep = time.monotonic() + TRASH_SWEEP_S
        while not (self.retiring and not self.boxes and not self.cleaners):
            if late_reclaim and time.monotonic() >= late_reclaim:
                late_reclaim = 0.0
                self.reclaim_stale()
            if time.monotonic() >= next_sweep:
                next_sweep = time.monotonic() + TRASH_SWEEP_S
                self.sweep_trash()
            for key, _ in self.selector.select(self.next_timeout()):
                if key.data == "accept":
                    with contextlib.suppress(OSError):
                        conn, _ = listener.accept()
                        self.handle(conn)
                elif key.data == "signal":
                    with contextlib.suppress(OSError):
                        os.read(wake_r, 4096)
                else:
                    self.progress(key.data)
            self.reap()
            self.expire_launches()
            if self.boxes or self.launches or self.cleaners:
                self.idle_since = time.monotonic()
            elif time.monotonic() - self.idle_since > IDLE_EXIT_S:
                break  # nobody used this version for a while: the next `ensure` starts one again
        with contextlib.suppress(OSError):
            if os.stat(self.socket_path).st_ino == os.fstat(listener.fileno()).st_ino:
                os.unlink(self.socket_path)

    def next_timeout(self):
        if not self.launches:
            return 1.0
        return max(0.0, min(1.0, min(launch.deadline for launch in self.launches.values()) - time.monotonic()))

    def handle(self, conn):
        conn.settimeout(5)
        fds = []
        try:
            data, fds = _receive_request(conn)
            request = json.loads(data)
            op = request.get("op")
            if op == "remove":
                self.remove(conn, request.get("ids", []))
                return
            if op == "launch":
                reply = self.launch(conn, request, fds)
                if reply is None:
                    return  # answered when the sandbox has set itself up
            else:
                reply = self.answer(op, request)
        except Exception as exc:
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        _close_all(fds)
        _reply(conn, reply)

    def answer(self, op, request):
        if op == "ping":
            return {"ok": True, "version": self.version, "pid": os.getpid(), "sandboxes": len(self.boxes)}
        if op == "list":
            return {"ok": True, "sandboxes": [box.describe() for box in self.boxes.values()]}
        if op == "retire":
            self.retire()
            return {"ok": True}
        return {"ok": False, "error": f"unknown op {op!r}"}

    def launch(self, conn, request, fds):
        """Start a sandbox; None when the answer comes later (from ``progress``), else the error reply."""
        if self.retiring:
            return {"ok": False, "error": "the namespace daemon is retiring"}
        if not fds:
            return {"ok": False, "error": "launch needs the sandbox channel's file descriptors"}
        box = Box(request, self.state_dir)
        box.daemon = self.identity
        if box.id in self.boxes or not box.id.replace("-", "").isalnum():
            return {"ok": False, "error": f"bad or duplicate sandbox id {box.id!r}"}
        self.boxes[box.id] = box
        try:
            status_r = start_launch(box, fds, self.agent_code, self.mounts)
        except Exception as exc:
            box.state = "exited"
            self.cleanup(box)
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        self.launches[status_r] = Launch(conn, box, status_r, fds)
        self.selector.register(status_r, selectors.EVENT_READ, status_r)
        return None

    def progress(self, status_r):
        launch = self.launches.get(status_r)
        if launch is None:
            return
        try:
            chunk = os.read(status_r, 4096)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if chunk:
            launch.report += chunk
            return
        self.complete(launch)

    def expire_launches(self):
        now = time.monotonic()
        for launch in [launch for launch in self.launches.values() if launch.deadline <= now]:
            self.complete(launch)

    def complete(self, launch):
        """The launch's status pipe closed (or its time ran out): answer its request."""
        self.launches.pop(launch.status_r, None)
        self.selector.unregister(launch.status_r)
        os.close(launch.status_r)
        _close_all(launch.fds)
        box = launch.box
        try:
            pid = finish_launch(box, launch.report)
        except SetupError as exc:
            box.state = "exited"
            if box.pid:
                self.by_pid[box.pid] = box  # cleaned up when reaped
            else:
                self.cleanup(box)
            _reply(launch.conn, {"ok": False, "error": str(exc)})
            return
        box.state = "running"
        self.by_pid[pid] = box
        box.save()
        if box.doomed:  # removed while it was starting
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        unenforced = [c for c in CONTROLLERS if c not in box.cgroups]
        _reply(launch.conn, {"ok": True, "pid": pid, "unenforced_limits": unenforced})

    def remove(self, conn, ids):
        for sandbox_id in ids:
            box = self.boxes.get(sandbox_id)
            if box is None:
                continue
            box.doomed = True
            if box.pid:
                try:
                    os.kill(box.pid, signal.SIGKILL)
                except ProcessLookupError:  # gone and reaped already (not as our child): nothing will report it
                    if self.by_pid.pop(box.pid, None) is box:
                        box.state = "exited"
                        self.cleanup(box)
                except OSError:
                    pass
        self.waiting.append((conn, set(ids)))
        self.answer_waiting()

    def answer_waiting(self):
        still = []
        for conn, ids in self.waiting:
            if ids & set(self.boxes):
                still.append((conn, ids))
            else:
                _reply(conn, {"ok": True})
        self.waiting = still

    def retire(self):
        self.retiring = True
        for box in list(self.boxes.values()):
            box.doomed = True
            if box.pid:
                with contextlib.suppress(OSError):
                    os.kill(box.pid, signal.SIGKILL)

    def reap(self):
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if pid in self.cleaners:
                _, box = self.cleaners.pop(pid)
                if box is not None:
                    self.forget(box)
            elif pid in self.by_pid:
                box = self.by_pid.pop(pid)
                box.state = "exited"
                self.cleanup(box)
        self.answer_waiting()

    def cleanup(self, box):
        """After the sandbox died: its cgroups, scratch directory (in the background) and record go."""
        for path in box.cgroups.values():
            _remove_cgroup(path)
        if os.path.isdir(box.dir):
            trash = box.dir + ".removing"
            with contextlib.suppress(OSError):
                os.rename(box.dir, trash)
                self.remove_in_background(trash, box)
                return
        self.forget(box)

    def remove_in_background(self, path, box=None):
        """``rm -rf`` of ``path`` as a child reaped by ``reap`` (which then forgets ``box``, if any)."""
        proc = subprocess.Popen(["rm", "-rf", "--one-file-system", path], stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        self.cleaners[proc.pid] = (path, box)
        proc.returncode = 0  # reaped by our own waitpid loop, not by Popen

    def sweep_trash(self):
        """Remove again the ``*.removing`` folders no record stands for and none of our cleaners works on: one
        whose removal failed, or raced with the ``rm`` a killed daemon left running (both can stop short)."""
        boxes_dir = os.path.join(self.state_dir, "boxes")
        busy = {path for path, _ in self.cleaners.values()}
        with contextlib.suppress(OSError):
            for entry in os.listdir(boxes_dir):
                path = os.path.join(boxes_dir, entry)
                if not entry.endswith(".removing") or path in busy:
                    continue
                if os.path.exists(path[: -len(".removing")] + ".json"):
                    continue  # its sandbox's cleanup (ours, or another daemon's) is not over yet
                with contextlib.suppress(OSError):
                    self.remove_in_background(path)

    def forget(self, box):
        with contextlib.suppress(OSError):
            os.unlink(box.record)
        self.boxes.pop(box.id, None)

    def reclaim_stale(self):
        """Sandboxes recorded by a daemon that died (not one of another version that still runs): kill what
        is left of them and clean up."""
        boxes_dir = os.path.join(self.state_dir, "boxes")
        os.makedirs(boxes_dir, exist_ok=True)
        for entry in os.listdir(boxes_dir):
            path = os.path.join(boxes_dir, entry)
            if not entry.endswith(".json"):
                continue
            with contextlib.suppress(OSError, ValueError):
                with open(path) as f:
                    record = json.load(f)
                owner = record.get("daemon") or [0, None]
                if owner[0] and _starttime(owner[0]) == owner[1]:
                    continue  # its daemon lives: not ours to touch
                pid = record.get("pid") or 0
                if pid and _starttime(pid) == record.get("starttime"):
                    os.kill(pid, signal.SIGKILL)
                for cgroup in record.get("cgroups", {}).values():
                    _remove_cgroup(cgroup)
                shutil.rmtree(record.get("dir", ""), ignore_errors=True)
                shutil.rmtree(record.get("dir", "") + ".removing", ignore_errors=True)
                os.unlink(path)
        self.sweep_trash()


def _close_all(fds):
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _receive_request(conn):
    fds = array.array("i")
    data = b""
    while not data.endswith(b"\n"):
        chunk, ancdata, _, _ = conn.recvmsg(65536, socket.CMSG_SPACE(16 * fds.itemsize))
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[: len(payload) - (len(payload) % fds.itemsize)])
        if not chunk:
            break
        data += chunk
        if len(data) > MAX_REQUEST:
            raise ValueError("request too large")
    return data, list(fds)


def _reply(conn, reply):
    with contextlib.suppress(OSError):
        conn.sendall(json.dumps(reply).encode() + b"\n")
    with contextlib.suppress(OSError):
        conn.close()


# ----------------------------------------------------------------------------------------------- clients


class DaemonGone(OSError):
    """Nothing answered on the daemon's socket: refused or missing, or a daemon dying as it accepted (reset, or
    closed unanswered). ``call`` and ``attach`` exit with DAEMON_GONE_EXIT then, so the controller can start the
    daemon again (a remote node's calls go through those modes)."""


def call(socket_path, request, fds=(), timeout=60.0):
    """One request to the daemon; its JSON reply. DaemonGone when nothing answers."""
    data = b""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(socket_path)
            payload = json.dumps(request).encode() + b"\n"
            if fds:
                s.sendmsg([payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
            else:
                s.sendall(payload)
            while not data.endswith(b"\n"):
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
    except (ConnectionRefusedError, FileNotFoundError, ConnectionResetError, BrokenPipeError) as exc:
        raise DaemonGone(f"the nsbox daemon at {socket_path} does not answer: {exc!r}") from exc
    if not data:
        raise DaemonGone(f"the nsbox daemon at {socket_path} closed the request unanswered")
    return json.loads(data)


def version_of(source, agent_source):
    return hashlib.sha256(source + agent_source).hexdigest()[:16]


def socket_path(state_dir, version):
    """Each version of the daemon has its own socket: a node shared by two swectl versions runs one daemon
    of each (an idle one exits after IDLE_EXIT_S), and neither disturbs the other's sandboxes."""
    return os.path.join(state_dir, f"nsd-{version}.sock")


ENSURE_LOCK_TIMEOUT_S = 60.0


def ensure(state_dir, source, agent_source):
    """Start this version's daemon unless it already answers; returns its ping reply plus the socket. Two
    `ensure`s on one state directory at once (two controllers, or two nodes sharing a host) take turns on
    ``nsd.lock``: without it both could unlink and bind the socket, and one would fail with EADDRINUSE."""
    os.makedirs(state_dir, exist_ok=True)
    lock = os.open(os.path.join(state_dir, "nsd.lock"), os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + ENSURE_LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"another `nsbox ensure` held {state_dir}/nsd.lock for {ENSURE_LOCK_TIMEOUT_S:.0f}s"
                    ) from None
                time.sleep(0.05)
        return _ensure_locked(state_dir, source, agent_source, lock)
    finally:
        os.close(lock)


def _ensure_locked(state_dir, source, agent_source, lock):
    version = version_of(source, agent_source)
    path = socket_path(state_dir, version)
    with contextlib.suppress(OSError, ValueError):
        reply = call(path, {"op": "ping"}, timeout=5)
        if reply.get("ok"):
            return {**reply, "socket": path, "started": False}
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    os.chmod(path, 0o600)
    listener.listen(128)
    child = os.fork()
    if child == 0:
        os.close(lock)  # the daemon must not hold the `ensure` lock for its whole life
        os.setsid()
        if os.fork() != 0:
            os._exit(0)
        log = os.open(os.path.join(state_dir, "nsd.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        for fd in (null, log):
            os.close(fd)
        os.chdir("/")
        try:
            Daemon(state_dir, version, agent_source, path).serve(listener)
        finally:
            os._exit(0)
    os.waitpid(child, 0)
    listener.close()
    reply = call(path, {"op": "ping"}, timeout=10)
    return {**reply, "socket": path, "started": True}


def _pid_alive(pid):
    return bool(pid) and _starttime(pid) is not None


def attach(socket_path, request):
    """Hand stdin/stdout to the daemon as the new sandbox's channel (the SSH path), then wait for the
    sandbox to end: sshd closes a session's channel once its process exits, so this process must outlive
    the handover. It becomes ``tail --pid`` (about 1 MiB; it exits within a second of the sandbox)."""
    try:
        reply = call(socket_path, request, fds=(0, 1))
    except DaemonGone as exc:
        body = _error_frame(f"{DAEMON_GONE_MARK}: {exc}")
        os.write(1, struct.pack(">I", len(body)) + body)
        return DAEMON_GONE_EXIT
    if not reply.get("ok"):
        body = _error_frame(reply.get("error", "launch failed"))
        os.write(1, struct.pack(">I", len(body)) + body)
        return 1
    null = os.open("/dev/null", os.O_RDWR)
    os.dup2(null, 2)
    with contextlib.suppress(OSError):
        os.execvp("tail", ["tail", f"--pid={reply['pid']}", "-f", "/dev/null"])
    while _pid_alive(reply["pid"]):  # no coreutils tail: wait here
        time.sleep(1)
    return 0


def _error_frame(message):
    """An exec-agent error frame with id 0 (msgpack map: kind, id, error, errno)."""
    raw = message.encode(errors="replace")[:60000]
    return b"\x84\xa4kind\xa5error\xa2id\x00\xa5error\xda" + struct.pack(">H", len(raw)) + raw + b"\xa5errno\xc0"


class UnsafeMember(Exception):
    """A rootfs tarball member that would land outside the tree, or a device file."""


def _safe_member(member, dest):
    """Keep a member only if it stays inside ``dest``: no absolute name, no ``..``, no device or fifo (those
    under ``dev/`` are skipped: a sandbox mounts its own /dev over it), no hard link out of the tree, and no
    parent directory that is a symlink (which would redirect the write). Symlinks themselves may point
    anywhere: they resolve inside the sandbox's root. None: skip the member."""
    name = member.name
    parts = name.split("/")
    if name.startswith("/") or ".." in parts:
        raise UnsafeMember(f"{name!r}: absolute or '..' path")
    if member.ischr() or member.isblk() or member.isfifo():
        if parts[0] == "dev" or parts[:2] == [".", "dev"]:
            return None  # an export's /dev/console and the like: the sandbox mounts its own /dev there
        raise UnsafeMember(f"{name!r}: device file or fifo")
    if member.islnk() and (member.linkname.startswith("/") or ".." in member.linkname.split("/")):
        raise UnsafeMember(f"{name!r}: hard link to {member.linkname!r} outside the tree")
    parent = dest
    for part in parts[:-1]:
        if not part or part == ".":
            continue
        parent = os.path.join(parent, part)
        if os.path.islink(parent):
            raise UnsafeMember(f"{name!r}: its directory {part!r} is a symlink")
    return member


def unpack(state_dir, digest, stream):
    """Extract a rootfs tarball from ``stream`` into STATE_DIR/rootfs/DIGEST (atomically; the content's
    sha256 must match DIGEST). Returns the directory."""
    import tarfile

    final = os.path.join(state_dir, "rootfs", digest)
    if os.path.isdir(final):
        return final
    work = f"{final}.tmp-{os.getpid()}"
    os.makedirs(work)
    hasher = hashlib.sha256()

    class Hashing:
        def read(self, n=-1):
            data = stream.read(n)
            hasher.update(data)
            return data

    try:
        try:
            with tarfile.open(fileobj=Hashing(), mode="r|*") as tar:
                for member in tar:
                    member = _safe_member(member, work)
                    if member is None:
                        continue
                    try:  # our own checks ran; tarfile's filters (3.12+, backported) would refuse absolute symlinks
                        tar.extract(member, work, filter="fully_trusted")
                    except TypeError:  # an interpreter without extraction filters
                        tar.extract(member, work)
            while Hashing().read(1 << 20):  # tar's end-of-archive padding counts toward the digest
                pass
        except (tarfile.TarError, EOFError) as exc:
            raise UnsafeMember(f"not a complete tar archive ({exc})") from exc
        if hasher.hexdigest() != digest:
            got = hasher.hexdigest()[:16]
            raise UnsafeMember(f"content sha256 {got} is not the expected {digest[:16]} (truncated?)")
        for d in ("proc", "sys", "dev", "tmp"):
            _mkdirs(os.path.join(work, d))
        os.rename(work, final)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return final


def _read_blob(stream):
    n = int(stream.readline())
    return stream.read(n)


def main(argv, source):
    mode = argv[1] if len(argv) > 1 else ""
    stdin = sys.stdin.buffer
    if mode == "check":
        print(json.dumps(check_host()))
        return 0
    if mode == "ensure":
        agent_source = _read_blob(stdin)
        print(json.dumps(ensure(argv[2], source, agent_source)))
        return 0
    if mode == "call":
        try:
            print(json.dumps(call(argv[2], json.loads(stdin.read() or b"{}"))))
        except DaemonGone as exc:
            print(f"{DAEMON_GONE_MARK}: {exc}", file=sys.stderr)
            return DAEMON_GONE_EXIT
        return 0
    if mode == "attach":
        return attach(argv[2], json.loads(argv[3]))
    if mode == "unpack":
        try:
            print(json.dumps({"ok": True, "dir": unpack(argv[2], argv[3], stdin)}))
        except (UnsafeMember, OSError) as exc:
            while stdin.read(1 << 20):  # take the rest, so that the sender sees an answer, not a broken pipe
                pass
            print(json.dumps({"ok": False, "error": str(exc)}))
        return 0
    usage = "check | ensure STATE_DIR | call SOCKET | attach SOCKET REQUEST | unpack STATE_DIR SHA256"
    print(f"usage: nsbox {usage} (got {argv[1:]})", file=sys.stderr)
    return 2


if __name__ == "__swectl_nsbox__":
    sys.exit(main(sys.argv, globals().get("__nsbox_source__", b"")))
