#!/usr/bin/env python3
"""The Redis queue end to end: a real redis-server, the cluster under real mpirun
(launch/local-cluster.sh), producers writing with redis-py, and single-process
`strata generate` as the reference for every greedy result.

    test_queue.py STRATA MODEL CASE

Cases:
  equal200       200 requests in every entry form, 20 of them malformed: 180 ok results equal
                 to strata generate, 20 error results naming the problem, every entry
                 acknowledged, one result per id
  kill9          the whole MPI job killed with SIGKILL at a random point, three times, and
                 restarted each time: every request ends with exactly one result
  redis_restart  redis-server killed (SIGKILL) mid-run and restarted from its append-only
                 file (appendfsync always): every request ends with exactly one result
  poison         an entry that kills the first stage each time it runs: after
                 --max-deliveries runs it is in the dead-letter stream with an error result,
                 every other request completes
  sigterm        SIGTERM to a serving cluster: it finishes the running requests within the
                 grace period or hands them back; a restart answers every request once
  docs           the redis-cli and Python examples of docs/QUEUE.md, run as written
  logprobs       sampled and greedy requests with logprobs and penalties on a 2-rank cluster:
                 each logprob equals the log-softmax (at the temperature) of `strata score
                 --logits-out` for the same ids; each penalised greedy token is the argmax of
                 those logits after OpenAI's and CTRL's penalty formulas
  choices        n = 4: one result with four completions, choice i equal to the same request
                 with seed + i and n = 1
  secrets        a password-protected redis-server: the password is in no message of a
                 malformed URL, in no rank's argv (ps), log, result or run report of a
                 cluster started with it in its URL; submit, collect and serve each name a
                 missing or a wrong password; STRATA_REDIS_PASSWORD, REDISCLI_AUTH and
                 --redis-password-file each supply it
  dead_worker    kill -9 of one worker under a 30 s heartbeat timeout: the job ends within 5 s
                 with status 1; only entries that ran keep a delivery; a restart under a new
                 consumer name takes the rest over at once
  takeover       the whole job killed with SIGKILL; a restart under a new consumer name takes
                 the dead consumer's entries over within 5 s (its liveness mark ran out)
  start_stop     SIGTERM 0-300 ms after start to the script, to mpirun, to every rank: each
                 job ends within 15 s with nothing left running, and nothing is lost
  producer_ids   submit --file with bad lines (over request_bytes, not JSON, not UTF-8): the
                 good ones queued, each bad one named by line, exit 2; an id reused with
                 other content answered with an error naming the first entry; a prompt
                 whose bytes alone exceed the context refused before tokenizing; "results
                 stored" equal to what the results stream holds
  chat_openai    an OpenAI chat batch file (/v1/chat/completions) through submit, a 2-rank
                 cluster and collect --format openai: chat.completion lines whose prompts are
                 python3-jinja2's rendering of the model's chat template, tokenized
"""
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import redis

STRATA, MODEL, CASE = sys.argv[1:4]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEED = int(os.environ.get("STRATA_TEST_SEED", time.time_ns() % 100000))
random.seed(SEED)
TMP = tempfile.mkdtemp(prefix="strata-queue-")
REQ, RES, DEAD, DONE = "strata:requests", "strata:results", "strata:requests:dead", "strata:results:done"

WORDS = ["cat", "dog", "bird", "ball", "tree", "park", "girl", "boy", "sun", "box", "car", "fish"]
STARTS = ["Once upon a time", "One day", "Lily saw a", "Tom wanted a", "The little", "Sam and Mia"]


def log(msg):
    print(f"[test_queue {CASE} seed={SEED}] {msg}", flush=True)


def fail(msg):
    log("FAIL: " + msg)
    sys.exit(1)


class Redis:
    """A private redis-server on a free loopback port, AOF with appendfsync always."""

    def __init__(self, password=None):
        self.password = password
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        self.port = s.getsockname()[1]
        s.close()
        self.dir = os.path.join(TMP, "redis")
        os.makedirs(self.dir, exist_ok=True)
        self.proc = None
        self.start()

    def start(self):
        self.proc = subprocess.Popen(
            ["redis-server", "--bind", "127.0.0.1", "--port", str(self.port), "--dir", self.dir,
             "--save", "", "--appendonly", "yes", "--appendfsync", "always",
             "--logfile", os.path.join(self.dir, "redis.log"),
             *(["--requirepass", self.password] if self.password else [])])
        self.client = redis.Redis(port=self.port, socket_timeout=10, password=self.password)
        for _ in range(200):
            try:
                self.client.ping()
                return
            except redis.exceptions.ConnectionError:
                time.sleep(0.05)
        fail("redis-server did not start")

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    @property
    def url(self):
        return f"redis://127.0.0.1:{self.port}"


def descendants(pid):
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    kids = [int(p) for p in out]
    return kids + [d for k in kids for d in descendants(k)]


class Cluster:
    """launch/local-cluster.sh NP strata serve --redis ..."""

    # The heartbeat timeout is only how soon a dead rank is noticed; 10 s leaves room for a
    # loaded machine (ASan, other tests) to starve rank 0 of the CPU for a few seconds.
    def __init__(self, url, *args, np=3, name="run", heartbeat_timeout=10):
        self.log_path = os.path.join(TMP, f"{name}.log")
        env = dict(os.environ, STRATA=STRATA, STRATA_LOG_LEVEL=os.environ.get("STRATA_LOG_LEVEL", "warn"))
        cmd = ["bash", os.path.join(ROOT, "launch/local-cluster.sh"), str(np), "--model", MODEL,
               "--redis", url, "--threads", "1", "--heartbeat-interval", "0.2",
               "--heartbeat-timeout", str(heartbeat_timeout), *args]
        self.proc = subprocess.Popen(cmd, env=env, stdout=open(self.log_path, "w"), stderr=subprocess.STDOUT)

    def wait(self, seconds=120):
        try:
            return self.proc.wait(seconds)
        except subprocess.TimeoutExpired:
            self.kill9()
            fail(f"cluster did not end within {seconds} s; log:\n{self.tail()}")

    def kill9(self):
        """The whole job at once, as a node losing power would: launcher, mpirun, ranks."""
        pids = descendants(self.proc.pid) + [self.proc.pid]
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(10)
        return len(pids)

    def tail(self, n=30):
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-n:])


def reference(prompts, max_new):
    """strata generate over the prompts (greedy, one process): prompt ids and outputs."""
    out = subprocess.run([STRATA, "generate", "--model", MODEL, "--threads", "1", "--max-new-tokens",
                          str(max_new), "--format", "json"] + [a for p in prompts for a in ("--prompt", p)],
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        fail("strata generate: " + out.stderr[-2000:])
    return [json.loads(line) for line in out.stdout.splitlines()]


def expected(ref, n):
    """A greedy request for n tokens gets the first n of the longest run (EOS ends both)."""
    return ref["output_ids"][:n]


def results(r):
    got = {}
    for entry_id, fields in r.xrange(RES, "-", "+"):
        f = {k.decode(): v.decode() for k, v in fields.items()}
        if f["id"] in got:
            fail(f"two results for id {f['id']}")
        got[f["id"]] = f
    return got


def check_all_acknowledged(r, n_entries):
    pending = r.xpending(REQ, "strata")["pending"]
    if pending != 0:
        fail(f"{pending} entries pending")
    if r.hlen(DONE) < n_entries - 0:
        log(f"done hash has {r.hlen(DONE)} ids")


def after_progress(r, results_before, seconds=15):
    """Waits until a random few more results are stored, then a random fraction of a second:
    a point in the middle of the run, not only its start."""
    target = results_before + random.randint(1, 6)
    deadline = time.time() + seconds
    while r.xlen(RES) < target and time.time() < deadline:
        time.sleep(0.02)
    time.sleep(random.uniform(0, 0.5))


def valid_requests(n, max_new=40):
    """n greedy requests with distinct prompts and varied budgets, in every entry form."""
    prompts, reqs = [], []
    for i in range(n):
        p = f"{STARTS[i % len(STARTS)]} {WORDS[i % len(WORDS)]} {WORDS[(i * 7 + 3) % len(WORDS)]} {i}"
        prompts.append(p)
        reqs.append({"id": f"r{i}", "prompt": p, "max_new_tokens": random.randint(1, max_new)})
    return prompts, reqs


def entry_fields(q, form):
    """One request as a queue entry: flat fields, a `json` line, or an OpenAI batch line."""
    if form == "flat":
        return {k: str(v) for k, v in q.items()}
    if form == "json":
        return {"json": json.dumps(q)}
    body = {"model": "stories", "prompt": q["prompt"], "max_tokens": q["max_new_tokens"], "temperature": 0}
    return {"openai": json.dumps({"custom_id": q["id"], "method": "POST", "url": "/v1/completions", "body": body})}


def submit_valid(r, reqs, ref_by_id=None):
    for i, q in enumerate(reqs):
        form = ["flat", "json", "openai"][i % 3]
        if ref_by_id is not None and i % 5 == 4:  # as token ids, from the reference's tokenization
            q = {"id": q["id"], "prompt_ids": ref_by_id[q["id"]]["prompt_ids"], "max_new_tokens": q["max_new_tokens"]}
            form = "json"
        r.xadd(REQ, entry_fields(q, form))


def check_ok(got, reqs, refs):
    for q, ref in zip(reqs, refs):
        res = got.get(q["id"])
        if res is None:
            fail(f"no result for {q['id']}")
        if res["status"] != "ok":
            fail(f"{q['id']}: {res}")
        want = expected(ref, q["max_new_tokens"])
        if json.loads(res["output_ids"]) != want:
            fail(f"{q['id']}: {res['output_ids']} != strata generate's {want}")


# 20 malformed entries and a word their error must contain.
MALFORMED = [
    ({"max_new_tokens": "5"}, "exactly one of 'prompt'"),
    ({"prompt": "a", "max_new_tokens": "lots"}, "max_new_tokens"),
    ({"prompt": "a", "max_new_tokens": "-1"}, "max_new_tokens"),
    ({"prompt": "a", "max_new_tokens": "3000000000"}, "max_new_tokens"),
    ({"prompt": "a", "temperature": "warm"}, "temperature"),
    ({"prompt": "a", "top_p": "0"}, "top_p"),
    ({"prompt": "a", "colour": "red"}, "unknown field 'colour'"),
    ({"prompt": b"caf\xc3\x28"}, "not valid UTF-8"),
    ({"prompt": "a", "prompt_ids": "[1, 2]"}, "exactly one of 'prompt'"),
    ({"prompt_ids": "[1, 99999]"}, "outside the vocabulary"),
    ({"prompt_ids": "[]"}, "empty prompt"),
    ({"prompt": "word " * 700}, "tokens exceed the context"),
    ({"prompt": "x" * (1 << 20)}, "is above the limit"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"json": json.dumps({"prompt": "a", "stop": [1]})}, "stop[0] must be a string"),
    ({"json": "[" * 5000 + "]" * 5000}, "nested deeper"),
    ({"openai": json.dumps({"custom_id": "oa-n", "body": {"prompt": "a", "n": 0}})}, "field 'n' must be in [1, 16]"),
    ({"openai": json.dumps({"custom_id": "oa-url", "url": "/v1/embeddings", "body": {"prompt": "a"}})}, "url must be"),
    ({"prompt": "a", "seed": "-4"}, "seed"),
    ({"prompt": "a", "ignore_eos": "maybe"}, "ignore_eos"),
]


def case_equal200():
    srv = Redis()
    prompts, reqs = valid_requests(180)
    refs = reference(prompts, 40)
    ref_by_id = {q["id"]: ref for q, ref in zip(reqs, refs)}
    order = list(range(180 + len(MALFORMED)))
    random.shuffle(order)
    bad_ids = []
    for k in order:
        if k < 180:
            submit_valid(srv.client, [reqs[k]], ref_by_id)
        else:
            fields, _ = MALFORMED[k - 180]
            bad_ids.append((srv.client.xadd(REQ, fields).decode(), k - 180))
    c = Cluster(srv.url, "--exit-when-drained", "--micro-batches", "2", "--decode-iters", "4")
    rc = c.wait(300)
    if rc != 0:
        fail(f"exit {rc}:\n{c.tail()}")
    got = results(srv.client)
    check_ok(got, reqs, refs)
    errors = [g for g in got.values() if g["status"] == "error"]
    if len(errors) != len(MALFORMED):
        fail(f"{len(errors)} error results, want {len(MALFORMED)}: {[e['error'] for e in errors]}")
    for entry, k in bad_ids:
        res = next((g for g in got.values() if g["entry"] == entry), None)
        if res is None:
            fail(f"no result for malformed entry {entry} ({MALFORMED[k][1]})")
        if MALFORMED[k][1] not in res["error"]:
            fail(f"entry {entry}: error '{res['error'][:200]}' does not say '{MALFORMED[k][1]}'")
    if len(got) != 200:
        fail(f"{len(got)} results for 200 requests")
    check_all_acknowledged(srv.client, 200)
    log("180 results equal strata generate, 20 error results name their problem, all acknowledged")


def slow_requests(n):
    prompts, reqs = valid_requests(n, 60)
    for q in reqs:
        q["max_new_tokens"] = random.randint(20, 60)
    return prompts, reqs


def expect_every_result(srv, cluster, reqs, refs):
    """The run ends cleanly with exactly one ok result per request, each equal to the
    reference, and every entry acknowledged."""
    rc = cluster.wait(300)
    if rc != 0:
        fail(f"exit {rc}:\n{cluster.tail()}")
    got = results(srv.client)
    if len(got) != len(reqs):
        fail(f"{len(got)} results for {len(reqs)} requests")
    check_ok(got, reqs, refs)
    check_all_acknowledged(srv.client, len(reqs))


def case_single_process():
    """One rank: `strata serve --redis` as a one-stage cluster in the process, the same
    request path; results equal strata generate, every entry acknowledged."""
    srv = Redis()
    prompts, reqs = valid_requests(40)
    refs = reference(prompts, 40)
    submit_valid(srv.client, reqs, {q["id"]: ref for q, ref in zip(reqs, refs)})
    expect_every_result(srv, Cluster(srv.url, "--exit-when-drained", np=1, name="single"), reqs, refs)
    log("one process: 40 results equal strata generate, all acknowledged")


def case_kill9():
    srv = Redis()
    prompts, reqs = slow_requests(60)
    refs = reference(prompts, 60)
    submit_valid(srv.client, reqs)
    args = ("--exit-when-drained", "--consumer", "crash-test", "--micro-batches", "2",
            "--debug-step-delay", "0.01", "--max-batch", "8")
    for k in range(3):
        c = Cluster(srv.url, *args, name=f"kill{k}")
        after_progress(srv.client, srv.client.xlen(RES))
        done = srv.client.xlen(RES)
        n = c.kill9()
        log(f"kill -9 number {k + 1}: {n} processes, {done} results stored before")
    expect_every_result(srv, Cluster(srv.url, *args, name="final"), reqs, refs)
    log("60 requests, 3 kills: exactly one result each, all equal strata generate")


def case_redis_restart():
    srv = Redis()
    prompts, reqs = slow_requests(40)
    refs = reference(prompts, 60)
    submit_valid(srv.client, reqs)
    c = Cluster(srv.url, "--exit-when-drained", "--micro-batches", "2", "--debug-step-delay", "0.01",
                "--max-batch", "8", "--redis-timeout", "60")
    after_progress(srv.client, 0)
    srv.kill()
    log("redis-server killed")
    time.sleep(1.5)
    srv.start()
    log(f"redis-server restarted; {srv.client.xlen(RES)} results survived")
    expect_every_result(srv, c, reqs, refs)
    log("redis killed and restarted mid-run: one result per request, all equal strata generate")


def case_poison():
    poison(takeover=False)


def case_poison_takeover():
    poison(takeover=True)


def poison(takeover):
    """A request that kills a stage, among 30 that do not. Restarted under the same consumer
    name, the queue recovers its own pending entries one at a time; under a new name each
    run (a new Slurm job id), the entries of the dead run are taken over in bulk after
    --claim-idle and the coordinator must run each redelivered one alone."""
    srv = Redis()
    prompts, reqs = valid_requests(30)
    refs = reference(prompts, 40)
    crash_token = 499
    if any(crash_token in ref["prompt_ids"] for ref in refs):
        fail(f"a test prompt holds token {crash_token}")
    for i, q in enumerate(reqs):
        if i == 10:
            srv.client.xadd(REQ, {"id": "poison", "prompt_ids": f"[1, 403, {crash_token}, 261]", "max_new_tokens": "8"})
        submit_valid(srv.client, [q])
    args = ("--exit-when-drained", "--debug-crash-token", str(crash_token), "--max-deliveries", "3",
            "--claim-idle", "1")
    for run in range(1, 9):
        consumer = f"poison-test-{run}" if takeover else "poison-test"
        if takeover:
            time.sleep(1.2)  # the dead run's entries idle past --claim-idle
        c = Cluster(srv.url, *args, "--consumer", consumer, name=f"poison{run}", heartbeat_timeout=5)
        rc = c.wait(120)
        log(f"run {run}: exit {rc}")
        if rc == 0:
            break
    else:
        fail("the job never completed")
    if run != 4:
        fail(f"completed after {run} runs; expected 3 failed runs (deliveries 1-3) and a 4th that "
             f"dead-letters; dead letters: {srv.client.xrange(DEAD, '-', '+')}; last log:\n{c.tail()}")
    dead = srv.client.xrange(DEAD, "-", "+")
    if len(dead) != 1:
        fail(f"{len(dead)} dead letters")
    f = {k.decode(): v.decode() for k, v in dead[0][1].items()}
    if f.get("id") != "poison" or f.get("dead_letter_deliveries") != "4":
        fail(f"dead letter {f}")
    got = results(srv.client)
    if got["poison"]["status"] != "error" or "dead-lettered" not in got["poison"]["error"]:
        fail(f"poison result {got['poison']}")
    check_ok(got, reqs, refs)
    if len(got) != 31:
        fail(f"{len(got)} results for 31 requests")
    check_all_acknowledged(srv.client, 31)
    log("the poison entry is in the dead-letter stream after 4 deliveries; 30 others equal strata generate")


def case_sigterm():
    srv = Redis()
    prompts, reqs = slow_requests(30)
    refs = reference(prompts, 60)
    submit_valid(srv.client, reqs)
    args = ("--consumer", "term-test", "--micro-batches", "2", "--debug-step-delay", "0.02", "--max-batch", "8")
    c = Cluster(srv.url, *args, "--grace-period", "0.3", name="term")
    after_progress(srv.client, 0)
    t0 = time.time()
    c.proc.send_signal(signal.SIGTERM)
    rc = c.wait(30)
    took = time.time() - t0
    if rc == 0:
        fail("stopped with requests cut but exit status 0")
    if took > 10:
        fail(f"took {took:.1f} s to stop with a 0.3 s grace period")
    stored = srv.client.xlen(RES)
    handed_back = [p for p in srv.client.xpending_range(REQ, "strata", "-", "+", 100) if p["times_delivered"] == 0]
    pending = srv.client.xpending(REQ, "strata")["pending"]
    if len(handed_back) != pending:
        fail(f"{pending} pending, only {len(handed_back)} handed back with their count restored")
    log(f"SIGTERM: exit {rc} after {took:.1f} s, {stored} results stored, {pending} handed back")
    c = Cluster(srv.url, "--exit-when-drained", *args, name="drain")
    rc = c.wait(300)
    if rc != 0:
        fail(f"exit {rc}:\n{c.tail()}")
    got = results(srv.client)
    if len(got) != 30:
        fail(f"{len(got)} results for 30 requests")
    check_ok(got, reqs, refs)
    check_all_acknowledged(srv.client, 30)
    log("after SIGTERM and a restart: one result per request, all equal strata generate")


def case_docs():
    """The examples of docs/QUEUE.md are files the page shows verbatim; both run here."""
    doc = open(os.path.join(ROOT, "docs/QUEUE.md")).read()
    examples = {"sh": "docs/examples/queue-redis-cli.sh", "python": "docs/examples/queue_producer.py"}
    for lang, path in examples.items():
        text = open(os.path.join(ROOT, path)).read()
        if f"```{lang}\n{text}```" not in doc:
            fail(f"docs/QUEUE.md does not show {path} as it is")
    srv = Redis()
    c = Cluster(srv.url, "--grace-period", "5", name="docs")
    env = dict(os.environ, REDIS_URL=srv.url, STRATA=STRATA)
    for lang, path in examples.items():
        cmd = ["bash" if lang == "sh" else sys.executable, os.path.join(ROOT, path)]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
        log(f"{path}: exit {out.returncode}\n{out.stdout[-1500:]}{out.stderr[-1500:]}")
        if out.returncode != 0:
            c.proc.send_signal(signal.SIGTERM)
            c.wait(30)
            fail(f"{path} failed")
    c.proc.send_signal(signal.SIGTERM)
    c.wait(30)


def score_logits(ids):
    """`strata score --ids` on one sequence: its [len(ids), vocab] raw logits."""
    path = os.path.join(TMP, "logits.f32")
    out = subprocess.run([STRATA, "score", "--model", MODEL, "--threads", "1", "--ids",
                          " ".join(map(str, ids)), "--logits-out", path],
                         capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        fail("strata score: " + out.stderr[-2000:])
    import array
    a = array.array("f")
    with open(path, "rb") as f:
        a.frombytes(f.read())
    vocab = len(a) // len(ids)
    return [a[i * vocab:(i + 1) * vocab] for i in range(len(ids))]


def log_softmax(row, temperature):
    import math
    t = temperature if temperature > 0 else 1.0
    scaled = [x / t for x in row]
    m = max(scaled)
    z = m + math.log(sum(math.exp(x - m) for x in scaled))
    return [x - z for x in scaled]


def penalised(row, prompt, out_before, q):
    """The logits after the penalties, by the formulas: CTRL's repetition penalty on every
    token of the prompt and output, then OpenAI's frequency and presence penalties."""
    row = list(row)
    seen = set(prompt) | set(out_before)
    r = q.get("repetition_penalty", 1.0)
    for t in seen:
        row[t] = row[t] / r if row[t] > 0 else row[t] * r
    for t in set(out_before):
        c = out_before.count(t)
        row[t] -= q.get("frequency_penalty", 0.0) * c + q.get("presence_penalty", 0.0)
    return row


def serve_json_requests(reqs, np=2):
    srv = Redis()
    for q in reqs:
        srv.client.xadd(REQ, {"json": json.dumps(q)})
    c = Cluster(srv.url, "--exit-when-drained", np=np)
    rc = c.wait(300)
    if rc != 0:
        fail(f"exit {rc}:\n{c.tail()}")
    return {k: v for k, v in results(srv.client).items()}


def check_logprobs(res, q):
    prompt, out = json.loads(res["prompt_ids"]), json.loads(res["output_ids"])
    lps = json.loads(res["logprobs"])
    if len(lps) != len(out) or not out:
        fail(f"{q['id']}: {len(lps)} logprobs for {len(out)} tokens")
    logits = score_logits(prompt + out)
    t = q.get("temperature", 0.0)
    checked = 0
    for i, (tok, lp) in enumerate(zip(out, lps)):
        row = logits[len(prompt) - 1 + i]
        want = log_softmax(row, t)
        if lp["token"] != tok or abs(lp["logprob"] - want[tok]) > 2e-3:
            fail(f"{q['id']} token {i}: logprob {lp} != log-softmax {want[tok]:.5f} at T={t}")
        k = q.get("top_logprobs", 0) if q["logprobs"] is True else q["logprobs"]
        top = sorted(range(len(want)), key=lambda j: -want[j])[:k]
        got = [a["token"] for a in lp["top_logprobs"]]
        for a in lp["top_logprobs"]:
            if abs(a["logprob"] - want[a["token"]]) > 2e-3:
                fail(f"{q['id']} token {i}: top {a} != {want[a['token']]:.5f}")
        if len(got) != k or (set(got) != set(top) and abs(want[top[-1]] - want[got[-1]]) > 2e-3):
            fail(f"{q['id']} token {i}: top {got} != {top}")
        if t == 0:  # greedy: the token is the argmax of the penalised logits
            p = penalised(row, prompt, out[:i], q)
            best = max(range(len(p)), key=lambda j: p[j])
            second = max(p[j] for j in range(len(p)) if j != best)
            if best != tok and p[best] - second > 1e-3:
                fail(f"{q['id']} token {i}: {tok} is not the penalised argmax {best}")
        checked += 1
    return checked


def case_logprobs():
    reqs = [
        {"id": "sampled", "prompt": "Once upon a time", "temperature": 0.8, "seed": 5,
         "max_new_tokens": 16, "ignore_eos": True, "logprobs": True, "top_logprobs": 3},
        {"id": "penalised", "prompt": "Lily saw a cat. The cat", "temperature": 0,
         "frequency_penalty": 0.7, "presence_penalty": 0.3, "repetition_penalty": 1.3,
         "max_new_tokens": 24, "ignore_eos": True, "logprobs": 0},
        {"id": "greedy", "prompt": "Tom wanted a", "max_new_tokens": 12, "logprobs": 2,
         "ignore_eos": True},
    ]
    got = serve_json_requests(reqs)
    n = 0
    for q in reqs:
        if got.get(q["id"], {}).get("status") != "ok":
            fail(f"{q['id']}: {got.get(q['id'])}")
        n += check_logprobs(got[q["id"]], q)
    plain = reference([reqs[1]["prompt"]], 24)[0]["output_ids"]
    if plain == json.loads(got["penalised"]["output_ids"]):
        fail("the penalties changed nothing: the penalised output equals plain greedy")
    log(f"{n} tokens: logprobs equal strata score's log-softmax, penalised greedy tokens the "
        "penalised argmax")


def case_choices():
    base = {"prompt": "One day", "temperature": 1.0, "max_new_tokens": 12, "ignore_eos": True}
    reqs = [dict(base, id="four", n=4, seed=40)] + [
        dict(base, id=f"seed{s}", seed=s) for s in (41, 42, 43)]
    got = serve_json_requests(reqs)
    four = got["four"]
    choices = json.loads(four["choices"])
    if len(choices) != 4 or [c["index"] for c in choices] != [0, 1, 2, 3]:
        fail(f"n=4 gave {four}")
    outs = [c["output_ids"] for c in choices]
    if json.loads(four["output_ids"]) != outs[0]:
        fail("the top-level output is not choice 0")
    for i, s in enumerate((41, 42, 43), start=1):
        if outs[i] != json.loads(got[f"seed{s}"]["output_ids"]):
            fail(f"choice {i} != the request with seed {s}: {outs[i]}")
    if len({tuple(o) for o in outs}) < 2:
        fail(f"four completions, all the same: {outs}")
    if int(four["completion_tokens"]) != sum(len(o) for o in outs):
        fail("completion_tokens does not count every choice")
    log(f"n=4: four completions ({len({tuple(o) for o in outs})} distinct), choice i = seed 40+i")


LLAMA2_CHAT = os.path.join(ROOT, "tests/worker/text/data/llama2_chat_template.jinja")


def chat_model():
    """stories260K with a chat template: its files linked, its tokenizer_config.json given
    Llama-2's chat template (the same tokenizer family)."""
    folder = os.path.join(TMP, "chat-model")
    os.makedirs(folder)
    for name in os.listdir(MODEL):
        if name != "tokenizer_config.json":
            os.symlink(os.path.join(os.path.abspath(MODEL), name), os.path.join(folder, name))
    config = json.load(open(os.path.join(MODEL, "tokenizer_config.json")))
    config["chat_template"] = open(LLAMA2_CHAT).read()
    json.dump(config, open(os.path.join(folder, "tokenizer_config.json"), "w"))
    return folder, config


def jinja_render(config, messages):
    """The template as transformers renders it (its environment, raise_exception)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.ext import loopcontrols

    def raise_exception(message):
        raise ValueError(message)
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.globals["raise_exception"] = raise_exception
    return env.from_string(config["chat_template"]).render(
        messages=messages, add_generation_prompt=True, bos_token=config["bos_token"],
        eos_token=config["eos_token"])


def case_chat_openai():
    global MODEL
    MODEL, config = chat_model()
    chats = [
        [{"role": "user", "content": "Tell me a story about a cat."}],
        [{"role": "system", "content": "You tell short stories."},
         {"role": "user", "content": "A dog and a ball?"}],
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Once upon a time"},
         {"role": "user", "content": "More, with \"quotes\" and {braces}."}],
    ]
    batch = os.path.join(TMP, "chat-batch.jsonl")
    with open(batch, "w") as f:
        for i, m in enumerate(chats):
            body = {"model": "stories", "messages": m, "max_tokens": 20, "temperature": 0,
                    "logprobs": True, "top_logprobs": 2}
            f.write(json.dumps({"custom_id": f"chat{i}", "method": "POST",
                                "url": "/v1/chat/completions", "body": body}) + "\n")
    srv = Redis()
    sub = subprocess.run([STRATA, "submit", "--redis", srv.url, "--file", batch],
                         capture_output=True, text=True, timeout=60)
    if sub.returncode != 0:
        fail("strata submit: " + sub.stderr[-2000:])
    # The independent prompt: jinja2's rendering, tokenized, as a plain ids request.
    want_ids = []
    for i, m in enumerate(chats):
        text = jinja_render(config, m)
        tok = subprocess.run([STRATA, "tokenize", "--tokenizer", MODEL, "--text", text],
                             capture_output=True, text=True, timeout=60)
        want_ids.append(json.loads(tok.stdout)["ids"])
        srv.client.xadd(REQ, {"json": json.dumps({"id": f"ids{i}", "prompt_ids": want_ids[-1],
                                                  "max_new_tokens": 20})})
    c = Cluster(srv.url, "--exit-when-drained", np=2)
    if c.wait(300) != 0:
        fail(f"cluster failed:\n{c.tail()}")
    out = os.path.join(TMP, "chat-out.jsonl")
    col = subprocess.run([STRATA, "collect", "--redis", srv.url, "--out", out, "--format", "openai"],
                         capture_output=True, text=True, timeout=60)
    if col.returncode != 0:
        fail("strata collect: " + col.stderr[-2000:])
    lines = {json.loads(l)["custom_id"]: json.loads(l) for l in open(out)}
    raw = results(srv.client)
    for i in range(len(chats)):
        line = lines[f"chat{i}"]
        body = line["response"]["body"]
        if line["response"]["status_code"] != 200 or body["object"] != "chat.completion":
            fail(f"chat{i}: {line}")
        choice = body["choices"][0]
        content = choice["message"]["content"]
        if choice["message"]["role"] != "assistant" or not isinstance(content, str):
            fail(f"chat{i}: {choice}")
        if json.loads(raw[f"chat{i}"]["prompt_ids"]) != want_ids[i]:
            fail(f"chat{i}: prompt ids {raw[f'chat{i}']['prompt_ids']} != jinja2's {want_ids[i]}")
        if raw[f"chat{i}"]["output_ids"] != raw[f"ids{i}"]["output_ids"]:
            fail(f"chat{i}: output differs from the same prompt sent as ids")
        lp = choice["logprobs"]["content"]
        if len(lp) != body["usage"]["completion_tokens"] or len(lp[0]["top_logprobs"]) != 2:
            fail(f"chat{i}: logprobs {choice['logprobs']}")
        if "".join(t["token"] for t in lp) != content:
            fail(f"chat{i}: the tokens' texts {[t['token'] for t in lp]} do not add up to {content!r}")
    log(f"{len(chats)} chat lines served: prompts are jinja2's, outputs equal the ids requests")


SECRET = "s3cr3t-Pw-77"


def strata_cmd(args, env_extra=None, timeout=60):
    env = dict(os.environ, STRATA_LOG_LEVEL="info")
    for var in ("STRATA_REDIS_PASSWORD", "REDISCLI_AUTH"):
        env.pop(var, None)
    env.update(env_extra or {})
    return subprocess.run([STRATA, *args], capture_output=True, text=True, timeout=timeout, env=env)


def case_secrets():
    srv = Redis(password=SECRET)
    port = srv.port
    out = os.path.join(TMP, "collected.jsonl")
    # Malformed URLs carrying the password: each refused naming the part, never showing it.
    for url, needle in [(f"redis://:{SECRET}@127.0.0.1:99999", "the port"),
                        (f"redis://user:{SECRET}@127.0.0.1:{port}/x", "database number"),
                        (f"redis://:{SECRET}@", "names no host"),
                        (f"redis://{SECRET}@127.0.0.1:{port}", "names a user but no password"),
                        (f"rediss://:{SECRET}@127.0.0.1:{port}", "must start with redis://")]:
        for cmd in (["submit", "--redis", url, "--prompt", "x"],
                    ["collect", "--redis", url, "--out", out],
                    ["serve", "--redis", url, "--model", MODEL]):
            r = strata_cmd(cmd)
            text = r.stdout + r.stderr
            if r.returncode == 0 or needle not in text:
                fail(f"{cmd[0]} {url.replace(SECRET, '<pw>')}: exit {r.returncode}, want '{needle}': {text[-400:]}")
            if SECRET in text:
                fail(f"{cmd[0]}: the password is in its output: {text[-400:]}")
    log("malformed URLs: refused naming the part, the password never shown")
    # A missing or wrong password, named by every command.
    plain, wrong = f"redis://127.0.0.1:{port}", f"redis://:nope@127.0.0.1:{port}"
    for cmd in (["submit", "--prompt", "x"], ["collect", "--out", out],
                ["serve", "--model", MODEL, "--exit-when-drained"]):
        for url, needle in [(plain, "requires a password"), (wrong, "authentication failed")]:
            r = strata_cmd([cmd[0], "--redis", url, *cmd[1:]])
            if r.returncode == 0 or needle not in r.stderr:
                fail(f"{cmd[0]} with {url}: exit {r.returncode}, want '{needle}': {r.stderr[-400:]}")
    log("submit, collect and serve name a missing and a wrong password")
    # The password from the environment or a file: submit queues.
    pw_file = os.path.join(TMP, "pw")
    with open(pw_file, "w") as f:
        f.write(SECRET + "\n")
    ways = [({"STRATA_REDIS_PASSWORD": SECRET}, []), ({"REDISCLI_AUTH": SECRET}, []),
            ({}, ["--redis-password-file", pw_file])]
    for env_extra, extra in ways:
        r = strata_cmd(["submit", "--redis", plain, *extra, "--prompt", "Once upon a time",
                        "--max-new-tokens", "4"], env_extra)
        if r.returncode != 0 or SECRET in r.stdout + r.stderr:
            fail(f"submit with {list(env_extra) or extra}: exit {r.returncode}: {r.stderr[-400:]}")
    if srv.client.xlen(REQ) != 3:
        fail(f"{srv.client.xlen(REQ)} requests queued, want 3")
    # A cluster started with the password in its URL: no rank's argv holds it.
    stats = os.path.join(TMP, "stats.json")
    c = Cluster(f"redis://:{SECRET}@127.0.0.1:{port}", "--exit-when-drained", "--stats-out", stats,
                name="secret")
    seen_ranks = 0
    deadline = time.time() + 60
    with open(f"/proc/{c.proc.pid}/cmdline", "rb") as f:
        launcher = f.read()  # what it was given (docs/QUEUE.md); its subshells share it
    while c.proc.poll() is None and time.time() < deadline:
        for pid in descendants(c.proc.pid):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv = f.read()
            except OSError:
                continue
            if argv == launcher:
                continue  # the script's own subshell (a command substitution), not a rank
            if STRATA.encode() in argv:
                seen_ranks += 1
            if SECRET.encode() in argv:
                fail(f"pid {pid}'s argv holds the password: {argv[:300]!r}")
        time.sleep(0.05)
    rc = c.wait(60)
    if rc != 0:
        fail(f"cluster exit {rc}:\n{c.tail()}")
    if seen_ranks == 0:
        fail("no rank was seen running")
    if len(results(srv.client)) != 3:
        fail(f"{len(results(srv.client))} results for 3 requests")
    r = strata_cmd(["collect", "--redis", plain, "--out", out], {"REDISCLI_AUTH": SECRET})
    if r.returncode != 0:
        fail(f"collect: {r.stderr[-400:]}")
    for path in (c.log_path, stats, out):
        with open(path, errors="replace") as f:
            if SECRET in f.read():
                fail(f"the password is in {os.path.basename(path)}")
    log(f"cluster with the password in its URL: {seen_ranks} argv samples, none holds it; "
        "results, log and run report free of it")

def rank_pid(cluster, rank):
    """The pid of MPI rank `rank` of a running cluster (its environment says which)."""
    deadline = time.time() + 20
    while time.time() < deadline:
        for p in descendants(cluster.proc.pid):
            try:
                env = open(f"/proc/{p}/environ", "rb").read().split(b"\0")
            except OSError:
                continue
            if f"PMIX_RANK={rank}".encode() in env and b"serve" in open(f"/proc/{p}/cmdline", "rb").read():
                return p
        time.sleep(0.02)
    fail(f"no process of rank {rank}")


def pending_on(r, consumer):
    return [p for p in r.xpending_range(REQ, "strata", "-", "+", 1000) if p["consumer"].decode() == consumer]


def wait_taken_over(r, consumer, since, limit=5.0):
    """Seconds from `since` until no entry is pending on `consumer` any more."""
    while pending_on(r, consumer):
        if time.time() - since > 60:
            fail(f"the entries of {consumer} were never taken over")
        time.sleep(0.05)
    took = time.time() - since
    if took > limit:
        fail(f"the entries of the dead consumer {consumer} were taken over after {took:.1f} s, "
             f"not within {limit} s (--claim-idle is 60 s)")
    return took


def case_dead_worker():
    """kill -9 of one worker under the default 30 s heartbeat timeout: the job ends within
    5 s with exit status 1 and names the rank; only entries that ran keep a delivery; a
    restart under a new consumer name takes the rest over at once and answers every request
    once, equal to strata generate."""
    srv = Redis()
    prompts, reqs = slow_requests(30)
    refs = reference(prompts, 60)
    submit_valid(srv.client, reqs)
    args = ("--micro-batches", "2", "--debug-step-delay", "0.02", "--max-batch", "8")
    c = Cluster(srv.url, *args, "--consumer", "dead-worker-1", name="dead", heartbeat_timeout=30)
    after_progress(srv.client, 0)
    victim = rank_pid(c, 2)
    t0 = time.time()
    os.kill(victim, signal.SIGKILL)
    rc = c.wait(60)
    took = time.time() - t0
    text = open(c.log_path, errors="replace").read()
    if took > 5:
        fail(f"the job ended {took:.1f} s after a worker's kill -9, not within 5 s:\n{c.tail()}")
    if rc != 1:
        fail(f"exit status {rc} after a dead worker; docs/CLUSTER.md says 1:\n{c.tail()}")
    if "worker rank 2 (stage layers [3, 5)) is dead: its process ended" not in text:
        fail(f"the dead rank is not named:\n{c.tail()}")
    pending = srv.client.xpending_range(REQ, "strata", "-", "+", 1000)
    ran = [p for p in pending if p["times_delivered"] > 0]
    if not pending or len(ran) > 8:
        fail(f"{len(pending)} pending, {len(ran)} with a delivery counted; at most the 8 running "
             f"(--max-batch 8) ran: {pending}")
    log(f"kill -9 of rank 2: exit {rc} after {took:.1f} s; {len(pending)} pending, {len(ran)} of "
        f"them ran; {srv.client.xlen(RES)} results stored")
    t1 = time.time()
    c = Cluster(srv.url, "--exit-when-drained", *args, "--consumer", "dead-worker-2", name="restart")
    took = wait_taken_over(srv.client, "dead-worker-1", t1)
    expect_every_result(srv, c, reqs, refs)
    log(f"restart under a new name took the entries over {took:.1f} s after it started; 30 results "
        "equal strata generate")


def case_takeover():
    """The whole job killed with SIGKILL (rank 0 too: nothing is handed back): a restart
    under a new consumer name takes the dead consumer's entries over within 5 s of its
    start (its liveness mark runs out; --claim-idle stays at 60 s), answers every request
    once, and removes the dead consumer from the group and the consumers hash."""
    srv = Redis()
    prompts, reqs = slow_requests(24)
    refs = reference(prompts, 60)
    submit_valid(srv.client, reqs)
    args = ("--micro-batches", "2", "--debug-step-delay", "0.02", "--max-batch", "4")
    c = Cluster(srv.url, *args, "--consumer", "takeover-1", name="first")
    after_progress(srv.client, 0)
    c.kill9()
    held = len(pending_on(srv.client, "takeover-1"))
    if held == 0:
        fail(f"the killed job held no entries: {srv.client.xpending_range(REQ, 'strata', '-', '+', 100)}; "
             f"{srv.client.xlen(RES)} results; log:\n{c.tail()}")
    t0 = time.time()
    c = Cluster(srv.url, "--exit-when-drained", *args, "--consumer", "takeover-2", name="second")
    took = wait_taken_over(srv.client, "takeover-1", t0)
    expect_every_result(srv, c, reqs, refs)
    names = [x["name"].decode() for x in srv.client.xinfo_consumers(REQ, "strata")]
    marks = {k.decode(): v.decode() for k, v in srv.client.hgetall(REQ + ":consumers:strata").items()}
    if "takeover-1" in names or "takeover-1" in marks:
        fail(f"the dead consumer is still listed: group {names}, marks {marks}")
    if marks.get("takeover-2") != "0":
        fail(f"the drained consumer's mark is {marks.get('takeover-2')}, not 0 (ended)")
    log(f"kill -9 of the whole job holding {held} entries: a new consumer took them over "
        f"{took:.1f} s after it started; 24 results equal strata generate; the dead consumer removed")


def case_start_stop():
    """SIGTERM 0, 50, 100, 200 and 300 ms after start, to launch/local-cluster.sh, to plain
    mpirun, and to every rank of a plain mpirun job as soon as they exist (as scancel
    does): each job ends within 15 s with none of its processes left; then one run answers
    every request once (nothing was lost), equal to strata generate."""
    srv = Redis()
    prompts, reqs = valid_requests(20, 16)
    refs = reference(prompts, 16)
    submit_valid(srv.client, reqs)
    env = dict(os.environ, STRATA=STRATA, STRATA_LOG_LEVEL="info", OMPI_MCA_rmaps_base_oversubscribe="1")
    if os.getuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    serve = ["--model", MODEL, "--redis", srv.url, "--threads", "1", "--max-batch", "4",
             "--debug-step-delay", "0.02", "--heartbeat-interval", "0.2"]
    for how in ("script", "mpirun", "ranks"):
        for delay in (0, 0.05, 0.1, 0.2, 0.3):
            name = f"stop-{how}-{int(delay * 1000)}"
            if how == "script":
                cmd = ["bash", os.path.join(ROOT, "launch/local-cluster.sh"), "3", *serve]
            else:
                cmd = ["mpirun", "-np", "3", "--bind-to", "none", STRATA, "serve", *serve]
            log_path = os.path.join(TMP, name + ".log")
            t0 = time.time()
            proc = subprocess.Popen(cmd + ["--consumer", name], env=env, stdout=open(log_path, "w"),
                                    stderr=subprocess.STDOUT, start_new_session=True)
            seen = set()
            time.sleep(delay)
            if how == "ranks":
                while not (kids := subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                                                  text=True).stdout.split()):
                    if proc.poll() is not None:
                        break
                    time.sleep(0.002)
                for k in kids:
                    os.kill(int(k), signal.SIGTERM)
            else:
                proc.send_signal(signal.SIGTERM)
            while proc.poll() is None and time.time() - t0 < 15:
                seen.update(descendants(proc.pid))
                time.sleep(0.02)
            took = time.time() - t0
            if proc.poll() is None:
                seen.update(descendants(proc.pid))
                for p in seen | {proc.pid}:
                    try:
                        os.kill(p, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                fail(f"{name}: still running {took:.1f} s after SIGTERM; log:\n"
                     + open(log_path, errors="replace").read()[-3000:])
            time.sleep(0.3)
            left = [p for p in seen if os.path.exists(f"/proc/{p}") and
                    b"zombie" not in open(f"/proc/{p}/status", "rb").read().lower()]
            if left:
                fail(f"{name}: processes {left} left running after the job ended")
            log(f"{name}: ended {took:.2f} s after start, exit {proc.returncode}, nothing left running")
    expect_every_result(srv, Cluster(srv.url, "--exit-when-drained", "--max-batch", "4",
                                     "--consumer", "stop-drain", name="drain"), reqs, refs)
    log("15 stops at every point of the start: nothing left running; then 20 results equal strata generate")



def case_producer_ids():
    srv = Redis()
    batch = os.path.join(TMP, "batch.jsonl")
    long_prompt = "Once upon a time " * 40000  # 680 KB: under request_bytes, far over 512 tokens
    lines = [json.dumps({"id": "p1", "prompt": "Once upon a time", "max_new_tokens": 4}).encode(),
             b"{not json",
             json.dumps({"id": "huge", "prompt": "x" * (1 << 20)}).encode(),
             b'{"id": "bad-utf8", "prompt": "caf\xc3\x28"}',
             json.dumps({"id": "long", "prompt": long_prompt}).encode(),
             json.dumps({"custom_id": "p1", "body": {"prompt": "The little dog", "max_tokens": 4}}).encode(),
             json.dumps({"id": "p2", "prompt": "One day", "max_new_tokens": 4}).encode()]
    with open(batch, "wb") as f:
        f.write(b"\n".join(lines) + b"\n")
    sub = subprocess.run([STRATA, "submit", "--redis", srv.url, "--file", batch],
                         capture_output=True, text=True, timeout=60)
    if sub.returncode != 2:
        fail(f"submit with bad lines: exit {sub.returncode}, want 2: {sub.stderr[-1500:]}")
    for needle in [f"{batch}:2: not valid JSON", f"{batch}:3: request: bytes = ", f"{batch}:4: not valid UTF-8",
                   "4 requests added to 'strata:requests', 3 lines of"]:
        if needle not in sub.stderr:
            fail(f"submit does not say '{needle}': {sub.stderr[-1500:]}")
    if srv.client.xlen(REQ) != 4:
        fail(f"{srv.client.xlen(REQ)} entries queued, want the 4 good lines")
    entries = [e.decode() for e, _ in srv.client.xrange(REQ, "-", "+")]
    c = Cluster(srv.url, "--exit-when-drained", np=1, name="ids")
    if c.wait(300) != 0:
        fail(f"cluster failed:\n{c.tail()}")
    got = results(srv.client)
    if got["p1"]["status"] != "ok" or got["p2"]["status"] != "ok" or got["p1"]["entry"] != entries[0]:
        fail(f"p1/p2: {got.get('p1')} {got.get('p2')}")
    conflict = got.get(entries[2])
    if conflict is None or conflict.get("reused_id") != "p1" or conflict.get("first_entry") != entries[0] \
            or f"'p1' was used first by entry {entries[0]}" not in conflict["error"]:
        fail(f"the reused id's entry: {conflict}")
    err = got["long"]["error"]
    if not err.startswith("field 'prompt': at least") or "refused before tokenizing" not in err:
        fail(f"long prompt: {err}")
    stored = [l for l in open(c.log_path) if "results stored" in l]
    want = f"{srv.client.xlen(RES)} results stored"
    if not stored or want not in stored[0] or "1 conflicting ids" not in stored[0]:
        fail(f"run report {stored}, want '{want}' and 1 conflicting id")
    log(f"submit refused 3 lines by number and queued 4; the reused id answered naming {entries[0]}; "
        f"the long prompt refused before tokenizing; {want}")


try:
    {"secrets": case_secrets, "dead_worker": case_dead_worker, "takeover": case_takeover,
     "start_stop": case_start_stop, "producer_ids": case_producer_ids, "equal200": case_equal200, "kill9": case_kill9, "redis_restart": case_redis_restart,
     "poison": case_poison, "poison_takeover": case_poison_takeover, "sigterm": case_sigterm,
     "docs": case_docs, "single_process": case_single_process, "logprobs": case_logprobs,
     "choices": case_choices, "chat_openai": case_chat_openai}[CASE]()
finally:
    for p in descendants(os.getpid()):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    shutil.rmtree(TMP, ignore_errors=True)
