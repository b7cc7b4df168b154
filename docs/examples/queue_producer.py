# Requests from Python (Debian: python3-redis): queue two prompts, then read the results
# stream until both have their result.
import json
import os
import time

import redis

r = redis.Redis.from_url(os.environ.get("REDIS_URL", "redis://127.0.0.1:6379"), decode_responses=True)
ids = []
for i, prompt in enumerate(["Once upon a time", "The little dog"]):
    r.xadd("strata:requests", {"id": f"py-{i}", "prompt": prompt, "max_new_tokens": 24,
                               "stop": json.dumps(["."])})
    ids.append(f"py-{i}")

results, last, deadline = {}, "0-0", time.time() + 60
while len(results) < len(ids) and time.time() < deadline:
    for _, entries in r.xread({"strata:results": last}, block=1000) or []:
        for entry_id, fields in entries:
            last = entry_id
            if fields["id"] in ids:
                results[fields["id"]] = fields
for i in ids:
    f = results[i]  # a KeyError here: no result within 60 s
    print(i, f["status"], f["stop_reason"], repr(f["text"]), json.loads(f["output_ids"]))
