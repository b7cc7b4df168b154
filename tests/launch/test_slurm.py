#!/usr/bin/env python3
"""Strata under a real one-node Slurm: munged, slurmctld and slurmd started here (as root,
everything under one temporary folder, ports of their own), a private redis-server, the
cluster submitted with the real launch/slurm/strata.sbatch, and single-process
`strata generate` as the reference for every greedy result.

    test_slurm.py STRATA MODEL CASE

Cases:
  drain       sbatch --ntasks=3 (coordinator + 2 stages under srun --mpi=pmix) over 30 queued
              requests: the job completes with exit code 0, its output says so, and every
              request has exactly one result, equal to strata generate's
  scancel     scancel in the middle of a job: it ends before Slurm's SIGKILL, the requests
              running then are finished and the rest handed back (delivery counts restored);
              a second job (a new consumer, --claim-idle 1) serves the rest: exactly one
              result per request, all equal to strata generate, nothing dead-lettered
  world_size  srun -n 3 with tasks that cannot join one MPI job (each an MPI world of its
              own): strata refuses to start, naming srun --mpi=pmix, and serves nothing; the
              same with --mpi=pmix serves; in a 3-task batch job, mpirun -np 2 (in the batch
              shell, and inside a one-task srun step as on a job's other nodes) and strata alone
              in the batch shell serve (no false alarm from Slurm's task counts)

Exits 77 (skipped) when not root or when a program it needs is missing. STRATA_TEST_KEEP=1
keeps the temporary folder (job outputs, daemon logs); STRATA_TEST_SEED repeats a run.
"""
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

STRATA, MODEL, CASE = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2]), sys.argv[3]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEMPLATE = os.path.join(ROOT, "launch/slurm/strata.sbatch")
SEED = int(os.environ.get("STRATA_TEST_SEED", time.time_ns() % 100000))
random.seed(SEED)
REQ, RES, DEAD, GROUP = "strata:requests", "strata:results", "strata:requests:dead", "strata"
KILL_WAIT = 30  # Slurm's default; the template's grace period is 10 s less
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
            "PREEMPTED", "BOOT_FAIL", "DEADLINE"}

WORDS = ["cat", "dog", "bird", "ball", "tree", "park", "girl", "boy", "sun", "box", "car", "fish"]
STARTS = ["Once upon a time", "One day", "Lily saw a", "Tom wanted a", "The little", "Sam and Mia"]


def log(msg):
    print(f"[test_slurm {CASE} seed={SEED}] {msg}", flush=True)


def fail(msg):
    log("FAIL: " + msg)
    sys.exit(1)


def skip(msg):
    log("SKIP: " + msg)
    sys.exit(77)


def preflight():
    if os.geteuid() != 0:
        skip("needs root (slurmd, slurmctld and munged run as root here)")
    missing = [p for p in ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel", "squeue",
                           "redis-server") if shutil.which(p) is None]
    if missing:
        skip("missing " + ", ".join(missing) + " (Debian: slurm-wlm munge redis-server)")
    try:
        import redis  # noqa: F401  (Debian: python3-redis)
    except ImportError:
        skip("missing the Python module redis (Debian: python3-redis)")


preflight()
import redis  # noqa: E402

TMP = tempfile.mkdtemp(prefix="strata-slurm-")
os.chmod(TMP, 0o755)  # munged refuses a socket folder others may write to, or cannot reach
# Every process this test starts (daemons, job steps, ranks) carries this in its environment,
# so that the end can find and stop exactly those.
MARK = ("STRATA_SLURM_TEST", TMP)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def clean_env(**extra):
    """This environment without any Slurm job's variables (the test may itself run under
    Slurm), plus the mark and `extra`."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "PMIX_", "OMPI_"))}
    env[MARK[0]] = MARK[1]
    env.update(extra)
    return env


class Slurm:
    """munged, slurmctld -D and slurmd -D under TMP; clients through SLURM_CONF."""

    def __init__(self):
        self.dir = os.path.join(TMP, "slurm")
        munge = os.path.join(self.dir, "munge")
        for d in (self.dir, munge, *(os.path.join(self.dir, sub) for sub in ("state", "spool", "tmp"))):
            os.makedirs(d, exist_ok=True)
            os.chmod(d, 0o755)
        key = os.path.join(munge, "munge.key")
        subprocess.run(["dd", "if=/dev/urandom", f"of={key}", "bs=1024", "count=1"], check=True,
                       capture_output=True)
        os.chmod(key, 0o400)
        self.socket = os.path.join(munge, "munge.socket")
        self.conf = os.path.join(self.dir, "slurm.conf")
        self.env = clean_env(SLURM_CONF=self.conf)
        self.procs = []
        self.start("munged", ["munged", "-F", f"--socket={self.socket}", f"--key-file={key}",
                              f"--pid-file={munge}/munged.pid", f"--log-file={munge}/munged.log",
                              f"--seed-file={munge}/munged.seed"])
        deadline = time.time() + 20
        while not os.path.exists(self.socket):
            if time.time() > deadline or self.procs[-1][1].poll() is not None:
                fail(f"munged did not start:\n{self.tail('munged.out')}")
            time.sleep(0.05)
        d = self.dir
        with open(self.conf, "w") as f:
            f.write(f"""ClusterName=stratatest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.socket}
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MailProg=/bin/true
MpiDefault=none
ReturnToService=2
TmpFS={d}/tmp
KillWait={KILL_WAIT}
MinJobAge=600
FirstJobId={random.SystemRandom().randint(1000, 999999)}
NodeName=localhost NodeAddr=127.0.0.1 CPUs={os.cpu_count()} State=UNKNOWN
PartitionName=test Nodes=localhost Default=YES MaxTime=INFINITE State=UP
""")
        self.start("slurmctld", ["slurmctld", "-D", "-i", "-f", self.conf])
        self.start("slurmd", ["slurmd", "-D", "-N", "localhost", "-f", self.conf])
        deadline = time.time() + 30
        while True:
            out = self.run(["scontrol", "show", "node", "localhost"], check=False).stdout
            if "State=IDLE" in out:
                break
            for name, p in self.procs:
                if p.poll() is not None:
                    fail(f"{name} exited with {p.returncode}:\n{self.tail(name + '.out')}"
                         f"{self.tail(name + '.log')}")
            if time.time() > deadline:
                fail(f"the node is not idle after 30 s: {out}\n{self.tail('slurmctld.log')}"
                     f"{self.tail('slurmd.log')}")
            time.sleep(0.2)
        mpi = self.run(["srun", "--mpi=list"], check=False)
        if "pmix" not in mpi.stdout + mpi.stderr:
            skip(f"Slurm has no PMIx plugin (srun --mpi=list: {mpi.stdout}{mpi.stderr})")
        log(f"Slurm up: {self.conf}")

    def start(self, name, cmd):
        out = open(os.path.join(self.dir, name + ".out"), "w")
        self.procs.append((name, subprocess.Popen(cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT)))

    def run(self, cmd, check=True, timeout=60, env=None):
        out = subprocess.run(cmd, env=env or self.env, capture_output=True, text=True, timeout=timeout)
        if check and out.returncode != 0:
            fail(f"{' '.join(cmd)}: exit {out.returncode}: {out.stdout}{out.stderr}")
        return out

    def tail(self, name, n=30):
        try:
            with open(os.path.join(self.dir, name), errors="replace") as f:
                return f"--- {name}\n" + "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def sbatch(self, name, serve_args, *options, script=TEMPLATE):
        """The template itself (or `script`), configured as a user would: environment and
        sbatch options."""
        out_path = os.path.join(TMP, f"{name}-%j.out")
        env = dict(self.env, STRATA=STRATA, STRATA_MODEL=MODEL, STRATA_REDIS=SERVER.url,
                   STRATA_SERVE_ARGS=" ".join(serve_args),
                   STRATA_LOG_LEVEL=os.environ.get("STRATA_LOG_LEVEL", "warn"))
        # 3 tasks on a 2-core node: --overcommit, one CPU (and thread) per task.
        cmd = ["sbatch", "--parsable", "--ntasks=3", "--cpus-per-task=1", "--overcommit",
               "--time=10", f"--output={out_path}", f"--chdir={TMP}", f"--job-name=strata-{name}",
               *options, script]
        job = self.run(cmd, env=env).stdout.strip().split(";")[0]
        log(f"sbatch {name}: job {job}")
        return job, out_path.replace("%j", job)

    def job(self, job):
        """scontrol's fields of the job (kept MinJobAge = 600 s after it ends)."""
        out = self.run(["scontrol", "show", "job", "-o", job], check=False).stdout.strip()
        return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)

    def wait_job(self, job, seconds):
        deadline = time.time() + seconds
        while time.time() < deadline:
            fields = self.job(job)
            if fields.get("JobState") in TERMINAL:
                return fields
            time.sleep(0.25)
        fields = self.job(job)
        self.run(["scancel", "--full", "--signal=KILL", job], check=False)
        fail(f"job {job} did not end within {seconds} s: JobState={fields.get('JobState')} "
             f"Reason={fields.get('Reason')}; output:\n{output(fields.get('StdOut', ''))[-3000:]}")

    def stop(self):
        for name, p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(5)


class Redis:
    """A private redis-server on a free loopback port."""

    def __init__(self):
        self.port = free_port()
        self.dir = os.path.join(TMP, "redis")
        os.makedirs(self.dir, exist_ok=True)
        self.proc = subprocess.Popen(
            ["redis-server", "--bind", "127.0.0.1", "--port", str(self.port), "--dir", self.dir,
             "--save", "", "--appendonly", "no", "--logfile", os.path.join(self.dir, "redis.log")],
            env=clean_env())
        self.client = redis.Redis(port=self.port, socket_timeout=10, decode_responses=True)
        for _ in range(200):
            try:
                self.client.ping()
                return
            except redis.exceptions.ConnectionError:
                time.sleep(0.05)
        fail("redis-server did not start")

    @property
    def url(self):
        return f"redis://127.0.0.1:{self.port}"

    def stop(self):
        self.proc.terminate()
        self.proc.wait(10)


def ours(pid):
    """Whether a process is this test's: the mark in its environment (daemons, job shells,
    srun, ranks) or a file under TMP open (slurmstepd holds slurmd's log; redis-server and
    slurmstepd rewrite their environment for their process titles)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            if f"{MARK[0]}={MARK[1]}".encode() in f.read().split(b"\0"):
                return True
        for fd in os.listdir(f"/proc/{pid}/fd"):
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(TMP + "/"):
                return True
    except OSError:
        pass
    return False


def kill_ours():
    pids = [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid() and ours(p)]
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


def requests(n, low, high):
    """n greedy requests with distinct prompts, as flat fields and `json` lines."""
    prompts, reqs = [], []
    for i in range(n):
        p = f"{STARTS[i % len(STARTS)]} {WORDS[i % len(WORDS)]} {WORDS[(i * 7 + 3) % len(WORDS)]} {i}"
        prompts.append(p)
        reqs.append({"id": f"s{i}", "prompt": p, "max_new_tokens": random.randint(low, high)})
    return prompts, reqs


def submit(reqs):
    for i, q in enumerate(reqs):
        SERVER.client.xadd(REQ, {k: str(v) for k, v in q.items()} if i % 2 else {"json": json.dumps(q)})


def reference(prompts, max_new):
    """strata generate over the prompts (greedy, one process, no Slurm)."""
    out = subprocess.run([STRATA, "generate", "--model", MODEL, "--threads", "1", "--max-new-tokens",
                          str(max_new), "--format", "json"] + [a for p in prompts for a in ("--prompt", p)],
                         capture_output=True, text=True, timeout=300, env=clean_env())
    if out.returncode != 0:
        fail("strata generate: " + out.stderr[-2000:])
    return [json.loads(line) for line in out.stdout.splitlines()]


def results():
    got = {}
    for _, f in SERVER.client.xrange(RES, "-", "+"):
        if f["id"] in got:
            fail(f"two results for id {f['id']}")
        got[f["id"]] = f
    return got


def check_every_result(reqs, refs):
    got = results()
    if len(got) != len(reqs):
        fail(f"{len(got)} results for {len(reqs)} requests")
    for q, ref in zip(reqs, refs):
        res = got.get(q["id"])
        if res is None:
            fail(f"no result for {q['id']}")
        if res["status"] != "ok":
            fail(f"{q['id']}: {res}")
        want = ref["output_ids"][:q["max_new_tokens"]]
        if json.loads(res["output_ids"]) != want:
            fail(f"{q['id']}: {res['output_ids']} != strata generate's {want}")
    pending = SERVER.client.xpending(REQ, GROUP)["pending"]
    if pending != 0:
        fail(f"{pending} entries still pending")
    dead = SERVER.client.xlen(DEAD) if SERVER.client.exists(DEAD) else 0
    if dead != 0:
        fail(f"{dead} dead letters: {SERVER.client.xrange(DEAD, '-', '+')}")


def output(path):
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def expect_completed(job, out_path, fields):
    text = output(out_path)
    if fields.get("JobState") != "COMPLETED" or fields.get("ExitCode") != "0:0":
        fail(f"job {job}: {fields.get('JobState')} exit {fields.get('ExitCode')}; output:\n{text[-4000:]}")
    if f"job {job}: srun exited with status 0" not in text:
        fail(f"job {job}'s output does not say that srun exited 0:\n{text[-4000:]}")


# Every run of the cluster: fast failure detection, as the queue tests use.
SERVE = ["--heartbeat-interval", "0.2", "--heartbeat-timeout", "10"]


def case_drain():
    prompts, reqs = requests(30, 1, 40)
    refs = reference(prompts, 40)
    submit(reqs)
    job, out_path = CLUSTER.sbatch("drain", SERVE + ["--micro-batches", "2", "--decode-iters", "4"])
    fields = CLUSTER.wait_job(job, 150)
    expect_completed(job, out_path, fields)
    text = output(out_path)
    if "3 tasks on localhost, 1 CPUs each (bind cores)" not in text:
        fail(f"job {job}'s output does not show its layout:\n{text[-3000:]}")
    check_every_result(reqs, refs)
    log(f"job {job}: COMPLETED 0:0; 30 results, each equal to strata generate")


def case_scancel():
    prompts, reqs = requests(40, 30, 60)
    refs = reference(prompts, 60)
    submit(reqs)
    args = SERVE + ["--micro-batches", "2", "--max-batch", "8", "--debug-step-delay", "0.03"]
    job, out_path = CLUSTER.sbatch("first", args)
    deadline = time.time() + 120
    target = random.randint(3, 8)
    while SERVER.client.xlen(RES) < target:
        state = CLUSTER.job(job).get("JobState")
        if state in TERMINAL:
            fail(f"job {job} ended ({state}) before {target} results:\n{output(out_path)[-3000:]}")
        if time.time() > deadline:
            fail(f"fewer than {target} results after 120 s:\n{output(out_path)[-3000:]}")
        time.sleep(0.05)
    time.sleep(random.uniform(0, 0.5))
    at_cancel = SERVER.client.xlen(RES)
    t0 = time.time()
    log(f"scancel {job} at {time.strftime('%H:%M:%S')}.{int(t0 * 1000) % 1000:03d}")
    CLUSTER.run(["scancel", job])
    fields = CLUSTER.wait_job(job, KILL_WAIT + 60)
    took = time.time() - t0
    text = output(out_path)
    stored = SERVER.client.xlen(RES)
    log(f"scancel after {at_cancel} results: job {job} {fields.get('JobState')} after {took:.1f} s, "
        f"{stored} results stored; the end of its output:\n" + "\n".join(text.splitlines()[-12:]))
    if fields.get("JobState") != "CANCELLED":
        fail(f"job {job} is {fields.get('JobState')}, not CANCELLED:\n{text[-3000:]}")
    if took > KILL_WAIT - 5:
        fail(f"job {job} took {took:.1f} s to stop: it ran into Slurm's SIGKILL (KillWait {KILL_WAIT} s)"
             f"\n{text[-3000:]}")
    if stored == len(reqs):
        fail("the first job finished every request: it was not cancelled in the middle")
    if stored <= at_cancel:
        fail(f"no request finished after scancel ({stored} results): the running ones were cut, "
             f"not given the grace period\n{text[-3000:]}")
    if "stopped with requests unfinished" not in text:
        fail(f"the coordinator did not stop on SIGTERM:\n{text[-3000:]}")
    grace = re.search(r"the requests running get ([0-9.]+) s to finish", text)
    if grace is None or float(grace.group(1)) + 5 > KILL_WAIT:
        fail(f"the grace period ({grace and grace.group(1)} s) does not end 5 s before Slurm's "
             f"SIGKILL (KillWait {KILL_WAIT} s):\n{text[-3000:]}")
    if f"job {job}: srun exited with status" not in text:
        fail(f"the batch shell of job {job} did not outlive scancel's SIGTERM:\n{text[-3000:]}")
    pending = SERVER.client.xpending_range(REQ, GROUP, "-", "+", 1000)
    counted = [p for p in pending if p["times_delivered"] != 0]
    if not pending or counted:
        fail(f"{len(pending)} entries pending, {len(counted)} not handed back (delivery count kept): "
             f"{counted[:3]}")
    job2, out2 = CLUSTER.sbatch("second", args + ["--claim-idle", "1"])
    fields2 = CLUSTER.wait_job(job2, 150)
    expect_completed(job2, out2, fields2)
    check_every_result(reqs, refs)
    log(f"{len(pending)} requests handed back by job {job}, served by job {job2}: one result per "
        f"request, each equal to strata generate, no dead letter")


def case_world_size():
    """srun -n 3 whose tasks cannot find the step's PMI (SLURM_NODELIST removed: Open MPI then
    starts as a singleton): three MPI worlds of one, each of which would serve alone."""
    SERVER.client.xadd(REQ, {"id": "w0", "prompt": "Once upon a time", "max_new_tokens": "4"})
    cmd = ["srun", "--ntasks=3", "--overcommit", "--cpus-per-task=1", "--time=2",
           "env", "-u", "SLURM_NODELIST", STRATA, "serve", "--model", MODEL, "--redis", SERVER.url,
           "--exit-when-drained", "--threads", "1"]
    out = CLUSTER.run(cmd, check=False, timeout=120)
    text = out.stdout + out.stderr
    if out.returncode == 0:
        fail(f"srun without a PMI exited 0:\n{text[-3000:]}")
    want = "this process is an MPI world of its own (1 rank) but Slurm started 3 tasks in this step"
    if text.count(want) != 3 or "srun --mpi=pmix" not in text:
        fail(f"not every task refused to start with the world-size message:\n{text[-3000:]}")
    if SERVER.client.exists(RES):
        fail(f"a task served alone: {SERVER.client.xrange(RES, '-', '+')}")
    # The same step with --mpi=pmix is one world of 3 and serves the request.
    cmd = ["srun", "--mpi=pmix", "--ntasks=3", "--overcommit", "--cpus-per-task=1", "--time=2",
           STRATA, "serve", "--model", MODEL, "--redis", SERVER.url, "--exit-when-drained", "--threads",
           "1", *SERVE]
    out = CLUSTER.run(cmd, check=False, timeout=120)
    if out.returncode != 0 or len(results()) != 1:
        fail(f"srun --mpi=pmix: exit {out.returncode}, {len(results())} results:\n"
             f"{(out.stdout + out.stderr)[-3000:]}")
    # No false alarm where the world is right whatever the allocation's task count says: one
    # batch job of 3 tasks, three launches, each on a stream of its own (serve_on below).
    #   mpirun -np 2 in the batch shell: the ranks see SLURM_NTASKS=3 and a world of 2;
    #   mpirun -np 2 in an srun step of one task, as mpirun's daemons run on the other nodes
    #     of a job: SLURM_STEP_NUM_TASKS=1 and a world of 2;
    #   strata alone in the batch shell: SLURM_NTASKS=3 and one process.
    launches = {
        "mpirun": 'mpirun -np 2 --oversubscribe --bind-to none "$STRATA"',
        "mpirun_in_step": 'srun --ntasks=1 --overcommit mpirun -np 2 --oversubscribe --bind-to none "$STRATA"',
        "batch_shell": '"$STRATA"',
    }
    script = os.path.join(TMP, "launches.sbatch")
    with open(script, "w") as f:
        f.write("#!/bin/bash\nexport OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1\n"
                'serve_on() { "$@" serve --model "$STRATA_MODEL" --redis "$STRATA_REDIS" --exit-when-drained '
                '--threads 1 $STRATA_SERVE_ARGS --request-stream "w:$name" --result-stream "w:$name:out"; }\n')
        for name, launch in launches.items():
            SERVER.client.xadd(f"w:{name}", {"id": name, "prompt": "One day", "max_new_tokens": "4"})
            f.write(f'name={name}; serve_on {launch} || {{ echo "$name failed: $?"; exit 1; }}\n')
    job, out_path = CLUSTER.sbatch("launches", SERVE, script=script)
    fields = CLUSTER.wait_job(job, 150)
    served = {name: SERVER.client.xlen(f"w:{name}:out") for name in launches}
    if fields.get("JobState") != "COMPLETED" or fields.get("ExitCode") != "0:0" or set(served.values()) != {1}:
        fail(f"launches in a 3-task job: {fields.get('JobState')} exit {fields.get('ExitCode')}, "
             f"results {served}:\n{output(out_path)[-3000:]}")
    log("srun without a PMI: each of the 3 tasks refused to start; with --mpi=pmix: served; in a "
        "3-task job, mpirun -np 2 in the batch shell and in a one-task step, and one process "
        "in the batch shell: served")


CASES = {"drain": case_drain, "scancel": case_scancel, "world_size": case_world_size}
if CASE not in CASES:
    fail(f"unknown case {CASE}; cases: {', '.join(CASES)}")
CLUSTER = SERVER = None
t_start = time.time()
try:
    SERVER = Redis()
    CLUSTER = Slurm()
    CASES[CASE]()
    log(f"passed in {time.time() - t_start:.0f} s")
finally:
    if CLUSTER is not None:
        # Jobs first (their steps run under slurmstepd, which slurmd does not own), then the
        # daemons.
        CLUSTER.run(["scancel", "--full", "--signal=KILL", "--user=root"], check=False)
        CLUSTER.run(["scancel", "--user=root"], check=False)
        deadline = time.time() + 20
        while CLUSTER.run(["squeue", "-h"], check=False).stdout.strip() and time.time() < deadline:
            time.sleep(0.2)
        CLUSTER.stop()
    if SERVER is not None:
        SERVER.stop()
    left = kill_ours()
    if left:
        log(f"killed {len(left)} processes left behind: {left}")
    if os.environ.get("STRATA_TEST_KEEP"):
        log(f"kept {TMP} (STRATA_TEST_KEEP)")
    else:
        shutil.rmtree(TMP, ignore_errors=True)
