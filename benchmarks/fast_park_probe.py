"""The fast park path on a real GPU, beside the driver's checkpoint path, in one run (issue 29).

Child processes hold torch tensors; each "pages" child runs with the fast park library preloaded
(LD_PRELOAD, gpu_quota_ext/parking/pages/pages.c), each "plain" child without it. For 2, 20 and 56 GiB:
  - pages: the arena's making (populating and pinning, timed apart), then park and resume rounds through the
    library (GB/s, the first park apart from later ones), byte-exactness (per-tensor int64 sums and sampled
    bytes), the device memory NVML sees the process keep while parked;
  - checkpoint: the same sizes through the driver's checkpoint calls (lock + checkpoint, restore + unlock,
    as gpu_quota_ext/parking/checkpoint.py makes them), rounds interleaved with the pages rounds;
  - a swap (one pages child parks while another of the same size resumes) against the two done one by one;
  - --full-swap: the same on a full device (a plain child takes all the room but a margin), so that the resume's
    room is the park's own bytes: one by one, against the park releasing each 2 GiB piece as it is copied while
    the resume takes them back as they come (the library's pieces, pages.c);
  - an allocation loop (torch's cache warm, and one that empties the cache each time so that every tensor
    goes to cudaMalloc/cudaFree) and a small training step, with and without the library: ratio of medians;
  - the checkpoint path on a preloaded child (a kernel the fast path refuses still parks the old way);
  - a resume that finds the device full (a neighbour took the room): it must fail, leave the kernel parked
    and whole, and go through once the room is back (the checkpoint path loses the process there).
Rounds: 3 for 2 and 20 GiB, 1 for 56 GiB. Progress is printed line by line; JSON is written after every
phase to --out-json. Children die with this process (PR_SET_PDEATHSIG, and killed in `finally`).

    python3 benchmarks/fast_park_probe.py --build-only --out .probe       # here: compile the library
    PYTHONUNBUFFERED=1 timeout 290 python3 benchmarks/fast_park_probe.py --library-dir .probe \\
        --out-json $OUT/fast_park.json                                     # on the GPU machine
    python3 benchmarks/fast_park_probe.py --library-dir .probe --overhead-only --overhead-pairs 6 \\
        --bench-rounds 20 --pin-cpu 3 --out-json $OUT/overhead.json        # the allocation loops only, quieter:
        # 6 fresh processes per arm and one more plain one for an A/A control, pinned once ready (~70 s on an H200)

The GPU machine needs python3 with torch and pynvml, not this package's dependencies: the few modules used
are loaded from their files.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import os
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

GiB = 1 << 30
MiB = 1 << 20
REPO = Path(__file__).resolve().parent.parent
PAGES_DIR = REPO / "gpu_quota_ext" / "parking" / "pages"
PREFIX = "@@ "  # a child's replies; anything else it prints is noise
BUDGET_S = 275.0
# --overhead-only: about 0.2 s a bench on an H200, (2P + 2) benches a round: 20 rounds of 6 pairs ~56 s, plus the
# children's start and one warm-up bench each, in parallel (~15 s): ~70 s, inside the ~90 s asked of it.
OVERHEAD_ROUNDS = 20


def load_file(name: str, path: Path):
    """A module from its file, without importing the package above it (its dependencies are not there)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


ratio_of_medians_ci = load_file("gqx_bench_common", Path(__file__).resolve().parent / "_common.py").ratio_of_medians_ci

def say(*parts) -> None:
    print(*parts, flush=True)


# --------------------------------------------------------------------------------------------------------
# The child: holds tensors, answers one JSON command per line.
# --------------------------------------------------------------------------------------------------------


def child_main() -> None:
    try:  # die with the parent, whatever kills it
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    import torch

    pages_module = load_file("gqx_pages", PAGES_DIR / "__init__.py")
    pages = pages_module.Pages.in_process()
    state = {"tensors": [], "sums": [], "samples": [], "arena": None, "parks": 0, "raw": None}
    # --dry-run: tensors on the CPU, and the library (over the fake driver) given one buffer of its own, so
    # that every step of the protocol runs on a machine without a GPU.
    device = os.environ.get("GQX_PROBE_DEVICE", "cuda")
    dry = device == "cpu"
    sync = torch.cuda.synchronize if not dry else (lambda: None)
    empty_cache = torch.cuda.empty_cache if not dry else (lambda: None)

    def dry_buffer() -> None:
        if not dry or pages is None or state["raw"] is not None:
            return
        pointer, size = ctypes.c_void_p(), 3 * MiB
        malloc = pages.lib.cudaMalloc
        malloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
        if malloc(ctypes.byref(pointer), size) != 0:
            raise RuntimeError(f"cudaMalloc through the library failed: {pages.last_error()}")
        data = os.urandom(size)
        ctypes.memmove(pointer.value, data, size)
        state["raw"] = (pointer.value, data)

    def dry_intact() -> bool:
        return state["raw"] is None or ctypes.string_at(state["raw"][0], len(state["raw"][1])) == state["raw"][1]

    def reply(**answer) -> None:
        sys.stdout.write(PREFIX + json.dumps(answer) + "\n")
        sys.stdout.flush()

    def checksums():
        sums, samples = [], []
        for t in state["tensors"]:
            sums.append(sum(int(part.sum()) for part in t.split(1 << 24)))
            flat = t.view(torch.uint8)
            n = min(MiB, flat.numel())
            samples.append((flat[:n].cpu(), flat[-n:].cpu()))
        sync()
        return sums, samples

    def alloc(total: int, tensor: int = GiB) -> dict:
        start = time.perf_counter()
        torch.zeros(1, device=device)
        dry_buffer()
        first_use = time.perf_counter() - start
        start = time.perf_counter()
        left = total
        while left > 0:  # 1 GiB tensors by default: one torch segment each, as a model's big weights are
            n = min(tensor, left)
            state["tensors"].append(torch.empty(n // 8, dtype=torch.int64, device=device))
            left -= n
        for size in (64 * 1024, 256 * 1024, 1 * MiB, 4 * MiB, 12 * MiB):  # small and mid pools too
            for _ in range(4):
                state["tensors"].append(torch.empty(size // 8, dtype=torch.int64, device=device))
        sync()
        allocated = time.perf_counter() - start
        for t in state["tensors"]:
            t.random_()
        sync()
        state["sums"], state["samples"] = checksums()
        out = {"first_cuda_use_s": first_use, "allocate_s": allocated, "tensors": len(state["tensors"])}
        out.update(library_view())
        return out

    def library_view() -> dict:
        if pages is None:
            return {"preloaded": False}
        return {
            "preloaded": True,
            "active": pages.active(),
            "mappings": pages.mapping_count(),
            "mapped_bytes": pages.mapped_bytes(),
            "passthrough_bytes": pages.passthrough_bytes(),
            "library_error": pages.last_error(),
        }

    def verify() -> dict:
        sums, samples = checksums()
        bad_sums = sum(a != b for a, b in zip(sums, state["sums"]))
        bad_samples = sum(
            not (torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])) for a, b in zip(samples, state["samples"])
        )
        exact = bad_sums == 0 and bad_samples == 0 and dry_intact()
        return {"exact": exact, "bad_sums": bad_sums, "bad_samples": bad_samples}

    def arena(margin: int = 256 * MiB) -> dict:
        need = pages.mapped_bytes() + margin
        if state["arena"] is not None:
            state["arena"].close()
            state["arena"] = None
        a = pages.arena(need)
        state["arena"] = a
        return {"arena_bytes": a.size, "populate_s": a.populate_seconds, "register_s": a.register_seconds}

    def park(release: bool = False) -> dict:
        sync()
        empty_cache()  # what the parker asks a kernel before it parks (kernel_channel.py)
        out = {}
        if state["arena"] is None or state["arena"].size < pages.mapped_bytes():
            out["arena_made"] = arena()
        moved = pages.mapped_bytes()
        start = time.perf_counter()
        if release:
            pages.park(state["arena"], release_as_copied=True)
        else:
            pages.park(state["arena"])
        out.update(seconds=time.perf_counter() - start, bytes=moved, first=state["parks"] == 0)
        state["parks"] += 1
        return out

    def resume(wait: float = 0.0) -> dict:
        moved = pages.mapped_bytes()
        start = time.perf_counter()
        if wait:
            pages.resume(wait_for_room=wait)
        else:
            pages.resume()
        return {"seconds": time.perf_counter() - start, "bytes": moved}

    def bench() -> dict:
        out = {}
        sizes = [(512 << (i % 17)) for i in range(24)]  # 512 B .. 32 MiB
        for _ in range(20):  # warm
            xs = [torch.empty(s, dtype=torch.uint8, device=device) for s in sizes]
            del xs
        times = []
        for _ in range(300):
            start = time.perf_counter()
            xs = [torch.empty(s, dtype=torch.uint8, device=device) for s in sizes]
            del xs
            times.append(time.perf_counter() - start)
        out["alloc_loop_s"] = statistics.median(times)
        raw_sizes = (2 * MiB, 20 * MiB, 200 * MiB, GiB) if not dry else (2 * MiB, 4 * MiB)
        times = []
        for _ in range(12):  # every tensor a cudaMalloc and a cudaFree
            sync()
            start = time.perf_counter()
            xs = [torch.empty(s, dtype=torch.uint8, device=device) for s in raw_sizes]
            del xs
            empty_cache()
            times.append(time.perf_counter() - start)
        out["alloc_uncached_s"] = statistics.median(times[2:])
        torch.manual_seed(0)
        width = 2048 if not dry else 128
        model = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(width, width), torch.nn.ReLU())])
        model = model.to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        batch = torch.randn(512, width, device=device)
        times = []
        for step in range(40):
            sync()
            start = time.perf_counter()
            loss = model(batch).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            sync()
            if step >= 10:
                times.append(time.perf_counter() - start)
        out["train_step_s"] = statistics.median(times)
        del model, optimizer, batch
        empty_cache()
        return out

    def fake_driver():
        fake = ctypes.CDLL(os.environ["GQX_PAGES_LIBCUDA"])  # the instance the library opened (same path)
        fake.fake_device_used.restype = ctypes.c_size_t
        fake.fake_set_capacity.argtypes = [ctypes.c_size_t]
        return fake

    def fill(leave: int) -> dict:
        """Take all the device's free memory but `leave` bytes (a neighbour that leaves no room)."""
        if dry:  # this process's fake device shrinks to what it holds plus `leave`
            fake = fake_driver()
            fake.fake_set_capacity(fake.fake_device_used() + leave)
            return {"filled": None}
        free, _ = torch.cuda.mem_get_info()
        size = max(0, free - leave) // (2 * MiB) * (2 * MiB)
        state["filler"] = torch.empty(size, dtype=torch.uint8, device=device) if size else None
        return {"filled": size, "free_after": torch.cuda.mem_get_info()[0]}

    def unfill() -> dict:
        if dry:
            fake_driver().fake_set_capacity(1 << 40)
            return {}
        state["filler"] = None
        empty_cache()
        return {"free_after": torch.cuda.mem_get_info()[0]}

    def try_resume() -> dict:
        """A resume that may fail: its code, message and the state it leaves."""
        try:
            return {"resumed": True, **resume()}
        except pages_module.PagesError as error:
            return {"resumed": False, "code": error.code, "message": error.message, "state": pages.state()}

    ops = {"alloc": lambda c: alloc(int(c["bytes"]), int(c.get("tensor", GiB)))}
    ops.update(verify=lambda c: verify(), arena=lambda c: arena())
    ops.update(fill=lambda c: fill(int(c["leave"])), unfill=lambda c: unfill(), try_resume=lambda c: try_resume())
    ops.update(park=lambda c: park(bool(c.get("release"))), resume=lambda c: resume(float(c.get("wait", 0.0))))
    ops["bench"] = lambda c: bench()
    ops["view"] = lambda c: library_view()
    reply(ok=True, pid=os.getpid(), preloaded=pages is not None)
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "exit":
            break
        try:
            reply(ok=True, **ops[command["op"]](command))
        except Exception as error:  # every failure goes back to the parent, which decides
            reply(ok=False, error=f"{type(error).__name__}: {error}", code=getattr(error, "code", None))


# --------------------------------------------------------------------------------------------------------
# The parent: starts children, asks them, calls the checkpoint driver, reads NVML. Imports no torch.
# --------------------------------------------------------------------------------------------------------


class ChildFailed(Exception):
    pass


class Child:
    def __init__(
        self, name: str, preload: str | None, logs: Path, dry_driver: str | None = None, one_thread: bool = False
    ):
        self.name = name
        env = dict(os.environ)
        env.pop("LD_PRELOAD", None)
        if one_thread:
            env["OMP_NUM_THREADS"] = "1"
        if preload:
            env["LD_PRELOAD"] = preload
        if dry_driver:
            env.update(GQX_PROBE_DEVICE="cpu", GQX_PAGES_LIBCUDA=dry_driver)
        self.log = logs / f"{name}.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-u", __file__, "--child"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(self.log, "w"),
            env=env,
            text=True,
            bufsize=1,
        )
        self.pid = self.proc.pid
        # Lines are read by a thread of their own: a select() on the pipe misses lines already buffered.
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def send(self, op: str, **args) -> None:
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()

    def read(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                line = self.lines.get(timeout=max(0.01, left))
            except queue.Empty:
                raise ChildFailed(f"{self.name}: no answer in {timeout:.0f} s") from None
            if line is None:
                self.proc.wait(timeout=10)
                raise ChildFailed(f"{self.name} exited ({self.proc.poll()}): {self.tail()}")
            if line.startswith(PREFIX):
                answer = json.loads(line[len(PREFIX) :])
                if not answer.get("ok"):
                    raise ChildFailed(f"{self.name}: {answer.get('error')}")
                return answer

    def ask(self, op: str, timeout: float = 120, **args) -> dict:
        self.send(op, **args)
        return self.read(timeout)

    def tail(self) -> str:
        try:
            return self.log.read_text()[-1500:]
        except OSError:
            return ""

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass


def text(value) -> str:
    """NVML's strings: bytes from older bindings."""
    return value.decode() if isinstance(value, bytes) else str(value)


class DryDriver:
    """--dry-run: the checkpoint calls answered at once (the child keeps its memory)."""

    def lock(self, pid: int, timeout_ms: int) -> None:
        pass

    checkpoint = restore = unlock = lambda self, pid: None


class DryNvml:
    name, driver = "dry run (no GPU)", "none"

    def used_by(self, pid: int) -> int:
        return 0


class Nvml:
    def __init__(self):
        import pynvml

        self.nvml = pynvml
        pynvml.nvmlInit()
        self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        self.name = text(pynvml.nvmlDeviceGetName(self.handles[0])) if self.handles else "none"
        self.driver = text(pynvml.nvmlSystemGetDriverVersion())

    def used_by(self, pid: int) -> int:
        """The process's device memory, every device (0 when NVML does not list it)."""
        total = 0
        for handle in self.handles:
            for process in self.nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if process.pid == pid and process.usedGpuMemory:
                    total += process.usedGpuMemory
        return total


def host_available() -> int:
    with open("/proc/meminfo") as info:
        for line in info:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def gbps(moved: int, seconds: float) -> float:
    return round(moved / seconds / 1e9, 2) if seconds > 0 else float("nan")


def ratio(a, b):
    return round(a / b, 3) if a is not None and b else None


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


class Probe:
    def __init__(self, args, library: Path):
        self.args = args
        self.library = str(library.resolve())
        self.start = time.monotonic()
        self.logs = Path(tempfile.mkdtemp(prefix="fast-park-probe-"))
        self.children: list[Child] = []
        self.result: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "sizes": {}}
        self.dry_driver = None
        self.unit, self.unit_name = GiB, "GiB"
        if args.dry_run:  # sizes in MiB, tensors on the CPU, the fake driver under the library
            build = load_file("gqx_pages_build", PAGES_DIR / "build.py")
            fake = build.compile_shared(
                REPO / "tests" / "fake_cuda" / "fake_cuda.c",
                self.logs / "libcuda.so.1",
                flags=(*build.FLAGS, "-Wl,-soname,libcuda.so.1"),
                libs=(),
            )
            self.dry_driver = str(fake)
            self.unit, self.unit_name = MiB, "MiB"
            self.driver, self.nvml = DryDriver(), DryNvml()
        else:
            checkpoint = load_file("gqx_checkpoint", REPO / "gpu_quota_ext" / "parking" / "checkpoint.py")
            self.driver = checkpoint.CudaCheckpointDriver()
            self.driver.open()
            self.nvml = Nvml()
        self.result["device"] = {"name": self.nvml.name, "driver": self.nvml.driver}
        self.result["host_available_gib"] = round(host_available() / GiB, 1)

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        return self.args.budget - self.elapsed()

    def spawn(self, name: str, preload: bool, pin_now: bool = True) -> Child:
        # A child pinned later still sizes torch's thread pool by the CPUs it sees at start: told one thread, as
        # a child pinned at once finds itself (more threads on one CPU wait on each other: a dry run's training
        # step took 350 ms instead of 1).
        one_thread = not pin_now and self.args.pin_cpu is not None
        child = Child(name, self.library if preload else None, self.logs, self.dry_driver, one_thread)
        if pin_now and self.args.pin_cpu is not None:
            # Before the child's interpreter starts threads: they inherit it. The allocation loop's rounds
            # jumped between two modes 1.7x apart on an unpinned run (2026-12-04), with the library and without.
            os.sched_setaffinity(child.pid, {self.args.pin_cpu})
        self.children.append(child)
        return child

    def pin_ready(self, child: Child) -> dict:
        """Every thread of a child that is ready (torch imported) onto --pin-cpu; new threads inherit it. The
        affinity read back is what the JSON records."""
        cpus = {self.args.pin_cpu}
        tasks = Path(f"/proc/{child.pid}/task")
        threads = 0
        for task in tasks.iterdir():
            try:
                os.sched_setaffinity(int(task.name), cpus)
                threads += 1
            except ProcessLookupError:  # a thread that ended between the listing and here needs no pinning
                pass
        return {
            "name": child.name,
            "pid": child.pid,
            "threads": threads,
            "affinity": sorted(os.sched_getaffinity(child.pid)),
        }

    def ready(self, child: Child) -> None:
        hello = child.read(120)
        if child.name.startswith("pages") and not hello.get("preloaded"):
            raise ChildFailed(f"{child.name}: the library is not in the process (LD_PRELOAD={self.library})")

    def retire(self, *children: Child) -> None:
        for child in children:
            child.kill()

    def save(self) -> None:
        self.result["elapsed_s"] = round(self.elapsed(), 1)
        if self.args.out_json:
            Path(self.args.out_json).parent.mkdir(parents=True, exist_ok=True)
            Path(self.args.out_json).write_text(json.dumps(self.result, indent=1))

    # -- one path's round -------------------------------------------------------------------------------

    def pages_round(self, child: Child) -> dict:
        before = self.nvml.used_by(child.pid)
        parked = child.ask("park", timeout=180)
        left_on_device = self.nvml.used_by(child.pid)
        resumed = child.ask("resume", timeout=180)
        check = child.ask("verify", timeout=120)
        row = {
            "park_s": parked["seconds"],
            "resume_s": resumed["seconds"],
            "bytes": parked["bytes"],
            "park_gbps": gbps(parked["bytes"], parked["seconds"]),
            "resume_gbps": gbps(resumed["bytes"], resumed["seconds"]),
            "first_park": parked["first"],
            "device_before": before,
            "device_while_parked": left_on_device,
            "exact": check["exact"],
        }
        if "arena_made" in parked:
            row["arena_made_on_park"] = parked["arena_made"]
        return row

    def checkpoint_round(self, child: Child, moved: int) -> dict:
        before = self.nvml.used_by(child.pid)
        start = time.perf_counter()
        self.driver.lock(child.pid, 30000)
        try:
            self.driver.checkpoint(child.pid)
        except Exception:
            self.driver.unlock(child.pid)
            raise
        park = time.perf_counter() - start
        left_on_device = self.nvml.used_by(child.pid)
        start = time.perf_counter()
        self.driver.restore(child.pid)
        self.driver.unlock(child.pid)
        resume = time.perf_counter() - start
        check = child.ask("verify", timeout=120)
        return {
            "park_s": park,
            "resume_s": resume,
            "bytes": moved,
            "park_gbps": gbps(moved, park),
            "resume_gbps": gbps(moved, resume),
            "device_before": before,
            "device_while_parked": left_on_device,
            "exact": check["exact"],
        }

    # -- phases -----------------------------------------------------------------------------------------

    def size_phase(self, gib: int, rounds: int, pages: Child, plain: Child, keep_pages: bool = False) -> dict:
        total = gib * self.unit
        entry = self.result["sizes"].setdefault(f"{gib}{self.unit_name}", {"rounds": rounds})
        say(f"[{self.elapsed():5.1f}s] {gib} GiB: allocating in both children")
        pages.send("alloc", bytes=total)
        plain.send("alloc", bytes=total)
        entry["pages_alloc"] = pages.read(180)
        entry["plain_alloc"] = plain.read(180)
        view = entry["pages_alloc"]
        # The library must hold the tensors: a driver that refuses the virtual memory calls (or torch bypassing
        # cudaMalloc) would leave them to libcudart, and a "park" would move nothing.
        pages_ok = self.holds(view, total)
        if not pages_ok:
            entry["pages_refused"] = view
            say(f"[{self.elapsed():5.1f}s] {gib} GiB: THE LIBRARY DOES NOT HOLD THE TENSORS; pages skipped: {view}")
        say(
            f"[{self.elapsed():5.1f}s] {gib} GiB: {view['mappings']} mappings, {view['mapped_bytes'] / GiB:.2f} GiB "
            f"mapped, {view['passthrough_bytes']} B passed through; alloc {view['allocate_s']:.2f} s vs plain "
            f"{entry['plain_alloc']['allocate_s']:.2f} s"
        )
        if pages_ok:
            arena = pages.ask("arena", timeout=180)
            entry["arena"] = arena
            say(
                f"[{self.elapsed():5.1f}s] {gib} GiB: arena {arena['arena_bytes'] / GiB:.2f} GiB populated in "
                f"{arena['populate_s']:.2f} s, pinned in {arena['register_s']:.2f} s"
            )
        entry["pages"], entry["checkpoint"] = [], []
        for index in range(rounds):
            order = ("pages", "checkpoint") if index % 2 == 0 else ("checkpoint", "pages")
            for path in order:
                if path == "pages":
                    if not pages_ok:
                        continue
                    row = self.pages_round(pages)
                else:
                    if self.left() < self.checkpoint_estimate(total):
                        say(f"[{self.elapsed():5.1f}s] {gib} GiB: checkpoint round {index + 1} skipped (time)")
                        entry.setdefault("skipped", []).append(f"checkpoint round {index + 1}")
                        continue
                    row = self.checkpoint_round(plain, total)
                entry[path].append(row)
                say(
                    f"[{self.elapsed():5.1f}s] {gib} GiB round {index + 1} {path:10s}: park {row['park_s']:.3f} s "
                    f"({row['park_gbps']} GB/s), resume {row['resume_s']:.3f} s ({row['resume_gbps']} GB/s), "
                    f"left while parked {row['device_while_parked'] / MiB:.0f} MiB of "
                    f"{row['device_before'] / MiB:.0f}, exact {row['exact']}"
                )
            self.save()
        entry["summary"] = self.summarize(entry)
        say(f"[{self.elapsed():5.1f}s] {gib} GiB summary: {json.dumps(entry['summary'])}")
        self.save()
        return entry

    def holds(self, view: dict, total: int) -> bool:
        """The library serves the child's tensors (in a dry run: its one buffer; the tensors are on the CPU)."""
        need = 1 if self.args.dry_run else total
        return bool(view.get("active")) and view.get("mapped_bytes", 0) >= need

    @staticmethod
    def checkpoint_estimate(total: int) -> float:
        return total / 1.1e9 + total / 5.0e9 + 5  # 56 GiB parked in 33-55 s, resumed at ~5 GB/s (FACTS)

    @staticmethod
    def summarize(entry: dict) -> dict:
        out = {}
        for path in ("pages", "checkpoint"):
            rows = entry.get(path) or []
            if not rows:
                continue
            later = [r for r in rows if not r.get("first_park")] or rows
            out[path] = {
                "park_gbps_median": median([r["park_gbps"] for r in later]),
                "resume_gbps_median": median([r["resume_gbps"] for r in rows]),
                "park_s_median": round(median([r["park_s"] for r in later]), 4),
                "resume_s_median": round(median([r["resume_s"] for r in rows]), 4),
                "first_park_s": round(rows[0]["park_s"], 4) if rows[0].get("first_park") else None,
                "device_while_parked_max": max(r["device_while_parked"] for r in rows),
                "all_exact": all(r["exact"] for r in rows),
            }
        if "pages" in out and "checkpoint" in out:
            out["speedup_park"] = ratio(out["pages"]["park_gbps_median"], out["checkpoint"]["park_gbps_median"])
            out["speedup_resume"] = ratio(out["pages"]["resume_gbps_median"], out["checkpoint"]["resume_gbps_median"])
        return out

    @staticmethod
    def pooled(with_lib: list, without: list) -> dict:
        """Ratio of the medians of paired rounds, its bootstrap 95% interval over the rounds, and the median of
        each round's own ratio."""
        low, high = ratio_of_medians_ci(with_lib, without) if len(with_lib) > 1 else (None, None)
        return {
            "pages": median(with_lib),
            "plain": median(without),
            "ratio": ratio(median(with_lib), median(without)),
            "ratio_95ci": [round(low, 3), round(high, 3)] if low is not None else None,
            "median_paired_ratio": round(median([a / b for a, b in zip(with_lib, without)]), 3),
        }

    def bench_phase(self, pages: Child, plain: Child, rounds: int = 3) -> None:
        """Paired rounds, alternating which child goes first; per measure the ratio of the medians (pages over
        plain) with a bootstrap 95% interval over the rounds, and the median of each round's own ratio."""
        say(f"[{self.elapsed():5.1f}s] allocation loop and training step, with and without the library")
        rows = {"pages": [], "plain": []}
        for index in range(rounds):
            order = (pages, plain) if index % 2 == 0 else (plain, pages)
            for child in order:
                key = "pages" if child is pages else "plain"
                rows[key].append(child.ask("bench", timeout=120))
        out = {"rounds": rows, "pinned_cpu": self.args.pin_cpu}
        for measure in ("alloc_loop_s", "alloc_uncached_s", "train_step_s"):
            with_lib = [r[measure] for r in rows["pages"]]
            without = [r[measure] for r in rows["plain"]]
            out[measure] = self.pooled(with_lib, without)
            say(
                f"[{self.elapsed():5.1f}s]   {measure}: {median(with_lib) * 1e3:.3f} ms with, "
                f"{median(without) * 1e3:.3f} ms without, ratio of medians {out[measure]['ratio']} "
                f"(95% {out[measure]['ratio_95ci']}), median paired ratio {out[measure]['median_paired_ratio']}"
            )
        self.result["overhead"] = out
        self.save()

    def overhead_phase(self, pairs: list[tuple[Child, Child]], control: Child, rounds: int) -> None:
        """The allocation loops and the training step over several fresh processes per arm. One process per arm
        confounds the library with what is the process's own (address layout, where its memory landed): a
        cached loop that never calls the library came out 1.046 (95% [1.012, 1.102]) with one pair (2026-12-04).
        So: P pairs (pages-i, plain-i) and one more plain child, plain-control, benched against plain-0 every
        round (A/A: the spread that processes alone give). Each round visits the pairs in an order rotating
        with the round, each pair's own order alternating. Per measure: the ratio of the medians of the
        per-child medians with a bootstrap interval resampling pairs (children), the pooled ratio over all
        rounds with its interval over rounds, and the A/A ratio (plain-0 over plain-control) with its interval.
        Every child is pinned (all its threads) after an uncounted warm-up bench, when --pin-cpu is given."""
        say(
            f"[{self.elapsed():5.1f}s] allocation loop and training step over {len(pairs)} pairs of processes "
            f"and an A/A control, {rounds} rounds"
        )
        children = [child for pair in pairs for child in pair] + [control]
        # One bench each, all at once and before pinning, not counted: each child's one-time start (CUDA context,
        # cuBLAS, the optimizer's first step: ~1 s of CPU each) would otherwise run one child after another on the
        # pinned CPU in the first round, and be in its timings.
        for child in children:
            child.send("bench")
        for child in children:
            child.read(180)
        pinned = [self.pin_ready(child) for child in children] if self.args.pin_cpu is not None else []
        first_plain = pairs[0][1]
        visits = [*pairs, (first_plain, control)]  # the control pair takes its turn in the rotation
        rows: dict[str, list] = {child.name: [] for child in children}
        control_rows: dict[str, list] = {first_plain.name: [], control.name: []}
        for index in range(rounds):
            shift = index % len(visits)
            for position, (a, b) in enumerate(visits[shift:] + visits[:shift]):
                in_control = b is control
                for child in (a, b) if (index + position) % 2 == 0 else (b, a):
                    row = {"round": index, **child.ask("bench", timeout=120)}
                    row.pop("ok", None)
                    (control_rows if in_control else rows)[child.name].append(row)
        out: dict = {
            "pairs": len(pairs),
            "pinned_cpu": self.args.pin_cpu,
            "children": pinned,
            "rounds": {
                "pages": [row for pages, _ in pairs for row in rows[pages.name]],
                "plain": [row for _, plain in pairs for row in rows[plain.name]],
                "by_child": {name: found for name, found in rows.items() if name != control.name},
            },
        }
        for measure in ("alloc_loop_s", "alloc_uncached_s", "train_step_s"):
            with_lib = [r[measure] for r in out["rounds"]["pages"]]
            without = [r[measure] for r in out["rounds"]["plain"]]
            figures = self.pooled(with_lib, without)
            pages_medians = [median([r[measure] for r in rows[pages.name]]) for pages, _ in pairs]
            plain_medians = [median([r[measure] for r in rows[plain.name]]) for _, plain in pairs]
            # The same figures with each child's median as one sample: the interval resamples pairs (processes).
            figures["per_process"] = {
                **self.pooled(pages_medians, plain_medians),
                "pages_medians": pages_medians,
                "plain_medians": plain_medians,
                "pages_spread": ratio(max(pages_medians), min(pages_medians)),
                "plain_spread": ratio(max(plain_medians), min(plain_medians)),
            }
            aa = self.pooled(
                [r[measure] for r in control_rows[first_plain.name]], [r[measure] for r in control_rows[control.name]]
            )
            # named for what they are: both arms are plain
            aa["plain_0"], aa["plain_control"] = aa.pop("pages"), aa.pop("plain")
            figures["control"] = {"children": [first_plain.name, control.name], **aa}
            out[measure] = figures
            each, aa = figures["per_process"], figures["control"]
            say(
                f"[{self.elapsed():5.1f}s]   {measure}: per process {each['pages'] * 1e3:.3f} ms with, "
                f"{each['plain'] * 1e3:.3f} ms without, ratio {each['ratio']} (95% over pairs {each['ratio_95ci']}, "
                f"spread with {each['pages_spread']}, without {each['plain_spread']}); pooled ratio "
                f"{figures['ratio']} (95% {figures['ratio_95ci']}), median paired {figures['median_paired_ratio']}; "
                f"A/A {aa['ratio']} (95% {aa['ratio_95ci']})"
            )
        out["control"] = {"children": [first_plain.name, control.name], "rounds": control_rows}
        self.result["overhead"] = out
        self.save()

    def compatibility_phase(self, pages: Child) -> None:
        """The checkpoint path on a preloaded child: a kernel whose fast park fails still parks the old way."""
        say(f"[{self.elapsed():5.1f}s] checkpoint path on the preloaded 2 GiB child")
        try:
            row = self.checkpoint_round(pages, 2 * self.unit)
            self.result["checkpoint_on_preloaded"] = row
            say(
                f"[{self.elapsed():5.1f}s]   park {row['park_s']:.2f} s, resume {row['resume_s']:.2f} s, "
                f"exact {row['exact']}"
            )
        except Exception as error:
            self.result["checkpoint_on_preloaded"] = {"error": str(error)}
            say(f"[{self.elapsed():5.1f}s]   failed: {error}")
        self.save()

    def swap_rounds(self, a: Child, b: Child, rounds: int, piece_by_piece: bool) -> list:
        """a is running and b is parked: each round, one by one (a's park, then b's resume), then back as it was
        and both at once (piece by piece: the park releasing each piece as it is copied, the resume waiting for
        them); roles swap every round. The rows, every byte checked."""
        rows = []
        together_park = {"release": True} if piece_by_piece else {}
        together_resume = {"wait": 60.0} if piece_by_piece else {}
        for index in range(rounds):
            going, coming = (a, b) if index % 2 == 0 else (b, a)
            start = time.perf_counter()
            park1 = going.ask("park", timeout=180)
            resume1 = coming.ask("resume", timeout=180)
            alone = time.perf_counter() - start
            coming.ask("park", timeout=180)  # back as it was, one after the other (on a full device it must)
            going.ask("resume", timeout=180)
            start = time.perf_counter()
            going.send("park", **together_park)
            coming.send("resume", **together_resume)
            park2, resume2 = going.read(180), coming.read(180)
            together = time.perf_counter() - start
            exact = coming.ask("verify", timeout=120)["exact"]
            row = {
                "one_by_one_s": alone,
                "park_alone_s": park1["seconds"],
                "resume_alone_s": resume1["seconds"],
                "sum_of_copies_s": park1["seconds"] + resume1["seconds"],
                "longer_alone_s": max(park1["seconds"], resume1["seconds"]),
                "together_s": together,
                "together_park_s": park2["seconds"],
                "together_resume_s": resume2["seconds"],
                "bytes": park2["bytes"],
                "exact": exact,
            }
            rows.append(row)
            say(
                f"[{self.elapsed():5.1f}s]   swap {index + 1}: one by one {alone:.3f} s (park {park1['seconds']:.3f}, "
                f"resume {resume1['seconds']:.3f}); {'piece by piece' if piece_by_piece else 'together'} "
                f"{together:.3f} s (park {park2['seconds']:.3f}, resume {resume2['seconds']:.3f}); exact {exact}"
            )
        return rows

    @staticmethod
    def swap_ratios(rows: list) -> dict:
        together = median([r["together_s"] for r in rows])
        return {
            "together_over_one_by_one": ratio(together, median([r["one_by_one_s"] for r in rows])),
            "together_over_longer_alone": ratio(together, median([r["longer_alone_s"] for r in rows])),
        }

    def swap_phase(self, a: Child, b: Child, gib: int, rounds: int = 2) -> None:
        """a is running and b is parked, each holding `gib` GiB, with room for both: one by one, then together."""
        say(f"[{self.elapsed():5.1f}s] swap of {gib} GiB: one by one, then at once")
        rows = self.swap_rounds(a, b, rounds, piece_by_piece=False)
        ratios = self.swap_ratios(rows)
        self.result["swap"] = {"gib": gib, "rounds": rows, "together_over_sum": ratios["together_over_one_by_one"]}
        self.save()

    def full_swap_phase(self, a: Child, b: Child, filler: Child, gib: int, rounds: int) -> None:
        """a runs and b is parked, `gib` each, and `filler` takes the rest of the device but a margin: b can come
        back only into a's bytes. One by one (a's park, then b's resume), against both at once (a releasing
        each piece as it is copied, b waiting for them); roles swap every round."""
        say(f"[{self.elapsed():5.1f}s] swap of {gib} GiB on a full device: one by one, then piece by piece")
        total = gib * self.unit
        out: dict = {"gib": gib}
        # Tensors of 10 GiB: each one torch segment of five 2 GiB pieces, released and backed one by one.
        tensor = 10 * self.unit
        b.ask("alloc", timeout=180, bytes=total, tensor=tensor)
        b.ask("arena", timeout=180)
        b.ask("park", timeout=180)
        a.ask("alloc", timeout=180, bytes=total, tensor=tensor)
        a.ask("arena", timeout=180)
        out["fill"] = filler.ask("fill", timeout=120, leave=0 if self.args.dry_run else 2 * GiB)
        say(f"[{self.elapsed():5.1f}s]   ready: {json.dumps(out['fill'])}")
        out["rounds"] = rows = self.swap_rounds(a, b, rounds, piece_by_piece=True)
        out.update(self.swap_ratios(rows))
        say(
            f"[{self.elapsed():5.1f}s]   median ratios: piece by piece / one by one {out['together_over_one_by_one']}, "
            f"/ the longer copy alone {out['together_over_longer_alone']}"
        )
        self.result["full_swap"] = out
        self.save()

    def run(self) -> None:
        say(
            f"device {self.nvml.name}, driver {self.nvml.driver}, "
            f"host available {self.result['host_available_gib']} GiB"
        )
        # Every child starts now: their torch imports overlap; none touches CUDA before its first command.
        sizes = self.args.sizes
        phases = []
        if self.args.overhead_only:
            # Pinned only once ready (overhead_phase): 2P+1 torch imports on one core would take minutes.
            pairs = [
                (self.spawn(f"pages-{i}", True, pin_now=False), self.spawn(f"plain-{i}", False, pin_now=False))
                for i in range(self.args.overhead_pairs)
            ]
            control = self.spawn("plain-control", False, pin_now=False)
            rounds = self.args.bench_rounds or OVERHEAD_ROUNDS
            phases.append(("overhead", lambda: self.overhead_phase(pairs, control, rounds)))
            sizes = set()
        if self.args.full_swap:
            fa, fb = self.spawn("pages-swap-a", True), self.spawn("pages-swap-b", True)
            ff = self.spawn("plain-swap-filler", False)
            gib, rounds = self.args.full_swap_gib, self.args.full_swap_rounds
            phases.append(("full swap", lambda: self.full_swap_phase(fa, fb, ff, gib, rounds)))
            phases.append(("retire full swap", lambda: self.retire(fa, fb, ff)))
            sizes = set()
        if 2 in sizes:
            p2, c2 = self.spawn("pages-2", True), self.spawn("plain-2", False)
            phases += [
                ("2 GiB", lambda: self.size_phase(2, 3, p2, c2)),
                ("overhead", lambda: self.bench_phase(p2, c2, self.args.bench_rounds or 3)),
                ("checkpoint on preloaded", lambda: self.compatibility_phase(p2)),
                ("retire 2", lambda: self.retire(p2, c2)),
            ]
        if 20 in sizes:
            p20, c20, q20 = self.spawn("pages-20", True), self.spawn("plain-20", False), self.spawn("pages-20b", True)
            phases += [
                ("20 GiB", lambda: self.size_phase(20, 3, p20, c20)),
                ("resume without room", lambda: self.no_room_phase(p20, c20)),
                ("retire plain 20", lambda: self.retire(c20)),
                ("swap", lambda: self.swap_setup_and_run(p20, q20)),
                ("retire 20", lambda: self.retire(p20, q20)),
            ]
        if 56 in sizes:
            p56, c56 = self.spawn("pages-56", True), self.spawn("plain-56", False)
            phases.append(("56 GiB", lambda: self.big_phase(p56, c56)))
        for child in self.children:
            self.ready(child)
        say(f"[{self.elapsed():5.1f}s] {len(self.children)} children ready")
        for name, phase in phases:
            try:
                phase()
            except Exception as error:
                say(f"[{self.elapsed():5.1f}s] phase {name} failed: {error}")
                self.result.setdefault("errors", []).append(f"{name}: {error}")
                self.save()
        self.result["first_cuda_use"] = self.first_use()
        say(
            f"[{self.elapsed():5.1f}s] first CUDA use (context + first tensor): "
            f"{json.dumps(self.result['first_cuda_use'])}"
        )

    def first_use(self) -> dict:
        """Each size's children made their context at their first tensor: with the library against without."""
        pairs = [
            (entry["pages_alloc"]["first_cuda_use_s"], entry["plain_alloc"]["first_cuda_use_s"])
            for entry in self.result["sizes"].values()
            if "pages_alloc" in entry and "plain_alloc" in entry
        ]
        if not pairs:
            return {}
        with_lib, without = median([p for p, _ in pairs]), median([q for _, q in pairs])
        return {"pairs": pairs, "pages_s": with_lib, "plain_s": without, "ratio": ratio(with_lib, without)}

    def no_room_phase(self, pages: Child, neighbour: Child) -> None:
        """The rule that is fatal on the checkpoint path (a restore into a full device loses the process,
        cuda-checkpoint #44): a fast resume that finds no room must leave the kernel parked and whole."""
        say(f"[{self.elapsed():5.1f}s] resume without room: park, fill the device from a neighbour, resume")
        out: dict = {}
        pages.ask("park", timeout=180)
        if self.args.dry_run:  # one fake device per process: the parked child's own shrinks
            neighbour = pages
        out["fill"] = neighbour.ask("fill", timeout=120, leave=0 if self.args.dry_run else 4 * GiB)
        out["failed_resume"] = failed = pages.ask("try_resume", timeout=180)
        out["device_while_refused"] = self.nvml.used_by(pages.pid)
        out["unfill"] = neighbour.ask("unfill", timeout=120)
        out["resume"] = again = pages.ask("try_resume", timeout=180)
        out["exact"] = pages.ask("verify", timeout=120)["exact"]
        out["ok"] = (not failed["resumed"]) and failed.get("state") == "parked" and again["resumed"] and out["exact"]
        first = "went through (the device was not full?)" if failed["resumed"] else failed["message"]
        say(
            f"[{self.elapsed():5.1f}s]   first resume: {first}; state {failed.get('state')}; after room came "
            f"back: resumed {again['resumed']}, exact {out['exact']}"
        )
        self.result["resume_without_room"] = out
        self.save()

    def swap_setup_and_run(self, a: Child, b: Child) -> None:
        say(f"[{self.elapsed():5.1f}s] swap: second 20 GiB pages child allocates and parks")
        b.ask("alloc", timeout=180, bytes=20 * self.unit)
        b.ask("arena", timeout=180)
        b.ask("park", timeout=180)
        self.swap_phase(a, b, 20)

    def big_phase(self, pages: Child, plain: Child) -> None:
        """56 GiB: one round each, one child at a time (the arena and the checkpoint's host copy would not
        both fit beside everything else)."""
        total = 56 * self.unit
        entry = self.result["sizes"].setdefault(f"56{self.unit_name}", {"rounds": 1})
        if self.left() < 45:
            entry["skipped"] = [f"all ({self.left():.0f} s left)"]
            say(f"[{self.elapsed():5.1f}s] 56 GiB skipped: {self.left():.0f} s left (run again with --sizes 56)")
            return
        available = host_available()
        if available < total + 8 * self.unit:
            raise ChildFailed(f"host memory: {available / GiB:.1f} GiB available, 64 needed for the 56 GiB arena")
        try:
            self.big_pages(pages, total, entry)
        except ChildFailed as error:  # the checkpoint round still runs: it is the baseline
            entry["pages_error"] = str(error)
            say(f"[{self.elapsed():5.1f}s] 56 GiB pages failed: {error}")
        self.retire(pages)  # its pinned arena goes before the checkpoint's host copy comes
        self.big_checkpoint(plain, total, entry)
        entry["summary"] = self.summarize(entry)
        self.save()

    def big_pages(self, pages: Child, total: int, entry: dict) -> None:
        say(f"[{self.elapsed():5.1f}s] 56 GiB: pages child allocates")
        entry["pages_alloc"] = view = pages.ask("alloc", timeout=180, bytes=total)
        if not self.holds(view, total):
            raise ChildFailed(f"the library does not hold the tensors: {view}")
        entry["arena"] = arena = pages.ask("arena", timeout=180)
        say(
            f"[{self.elapsed():5.1f}s] 56 GiB: arena {arena['arena_bytes'] / GiB:.2f} GiB populated in "
            f"{arena['populate_s']:.2f} s, pinned in {arena['register_s']:.2f} s"
        )
        row = self.pages_round(pages)
        entry["pages"] = [row]
        say(
            f"[{self.elapsed():5.1f}s] 56 GiB pages: park {row['park_s']:.3f} s ({row['park_gbps']} GB/s), resume "
            f"{row['resume_s']:.3f} s ({row['resume_gbps']} GB/s), left while parked "
            f"{row['device_while_parked'] / MiB:.0f} MiB, exact {row['exact']}"
        )
        self.save()

    def big_checkpoint(self, plain: Child, total: int, entry: dict) -> None:
        if self.left() < self.checkpoint_estimate(total) + 15:
            say(f"[{self.elapsed():5.1f}s] 56 GiB checkpoint round skipped: {self.left():.0f} s left")
            entry["skipped"] = ["checkpoint round 1 (time)"]
            return
        say(f"[{self.elapsed():5.1f}s] 56 GiB: plain child allocates")
        entry["plain_alloc"] = plain.ask("alloc", timeout=180, bytes=total)
        row = self.checkpoint_round(plain, total)
        entry["checkpoint"] = [row]
        say(
            f"[{self.elapsed():5.1f}s] 56 GiB checkpoint: park {row['park_s']:.2f} s ({row['park_gbps']} GB/s), "
            f"resume {row['resume_s']:.2f} s ({row['resume_gbps']} GB/s), exact {row['exact']}"
        )

    def close(self) -> None:
        for child in self.children:
            child.kill()
        shutil.rmtree(self.logs, ignore_errors=True)


def library_in(folder: Path) -> Path:
    """The built library in `folder`; rebuilt beside it when it does not load here and a compiler does."""
    path = folder / "libgqx_pages.so"
    if not path.exists():
        raise SystemExit(f"no {path}: build it first (--build-only --out {folder})")
    try:
        ctypes.CDLL(str(path))
        return path
    except OSError as error:
        say(f"{path} does not load here ({error}); rebuilding")
        build = load_file("gqx_pages_build", PAGES_DIR / "build.py")
        return build.build(folder / "rebuilt")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build-only", action="store_true", help="compile the library into --out and stop")
    parser.add_argument("--out", help="folder for --build-only")
    parser.add_argument("--library-dir", help="folder holding libgqx_pages.so: run the probe")
    parser.add_argument("--out-json", help="where the results go (written after every phase)")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds to stay within")
    parser.add_argument(
        "--sizes",
        type=lambda text: {int(part) for part in text.split(",")},
        default={2, 20, 56},
        help="which of 2,20,56 GiB to run (2 brings the overhead timings, 20 the swap)",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="no GPU: MiB for GiB, CPU tensors, the tests' fake CUDA driver"
    )
    parser.add_argument(
        "--bench-rounds",
        type=int,
        help="paired rounds of the allocation loops and the training step (default 3; with --overhead-only "
        f"{OVERHEAD_ROUNDS}: each round benches every pair and the A/A pair, ~0.2 s a bench on an H200, so "
        "6 pairs take ~3 s a round and the mode ~70 s in all)",
    )
    parser.add_argument(
        "--overhead-only", action="store_true", help="only the allocation loops and the training step (no parks)"
    )
    parser.add_argument(
        "--overhead-pairs",
        type=int,
        default=6,
        help="--overhead-only: fresh processes per arm (pages and plain), plus one plain-control for an A/A",
    )
    parser.add_argument(
        "--pin-cpu",
        type=int,
        help="run every child on this one CPU (quieter timings: no migration between cores); with "
        "--overhead-only every thread of each child is pinned once the child is ready",
    )
    parser.add_argument(
        "--full-swap",
        action="store_true",
        help="only the swap on a full device (two pages children of --full-swap-gib and a plain one that fills "
        "the rest): one by one against piece by piece",
    )
    parser.add_argument(
        "--full-swap-gib",
        type=int,
        default=40,
        help="each child's GiB for --full-swap (two pinned arenas of this size must fit the host: 40 on 128 GiB)",
    )
    parser.add_argument("--full-swap-rounds", type=int, default=4, help="rounds of --full-swap (roles swap each)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child_main()
        return 0
    if args.build_only:
        if not args.out:
            parser.error("--build-only needs --out DIR")
        build = load_file("gqx_pages_build", PAGES_DIR / "build.py")
        say(build.build(args.out))
        return 0
    if args.full_swap and not (1 <= args.full_swap_gib <= 64 and args.full_swap_rounds >= 1):
        parser.error("--full-swap needs --full-swap-gib between 1 and 64 and at least one round")
    if args.overhead_pairs < 1:
        parser.error("--overhead-pairs needs at least 1")
    if args.pin_cpu is not None and args.pin_cpu not in os.sched_getaffinity(0):
        parser.error(f"--pin-cpu {args.pin_cpu}: not one of this process's CPUs {sorted(os.sched_getaffinity(0))}")
    if not args.library_dir:
        parser.error("give --build-only --out DIR, or --library-dir DIR")
    library = library_in(Path(args.library_dir))

    def stop(signum, frame):  # timeout(1) sends SIGTERM: end through `finally`, children killed
        raise SystemExit(f"stopped by signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    probe = Probe(args, library)
    try:
        probe.run()
    finally:
        probe.close()
        probe.save()
        say(f"[{probe.elapsed():5.1f}s] done; JSON: {args.out_json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
