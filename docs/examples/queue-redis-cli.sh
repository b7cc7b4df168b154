# One request with redis-cli: queue it, wait for its result, print the result entry.
url=${REDIS_URL:-redis://127.0.0.1:6379}
redis-cli -u "$url" XADD strata:requests '*' id cli-1 prompt "Once upon a time" max_new_tokens 16
# strata:results:done maps each answered request id to its result's entry id.
for _ in $(seq 600); do
  entry=$(redis-cli -u "$url" HGET strata:results:done cli-1)
  [ -n "$entry" ] && break
  sleep 0.1
done
[ -n "$entry" ] || { echo "no result for cli-1 after 60 s" >&2; exit 1; }
redis-cli -u "$url" XRANGE strata:results "$entry" "$entry"
