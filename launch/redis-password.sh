# Sourced by the launch scripts: a password in a --redis URL reaches the ranks through
# their environment (STRATA_REDIS_PASSWORD, which strata reads: docs/QUEUE.md), not their
# argv, which `ps` shows to every user of the node.
#   strip_redis_passwords "$@"; set -- "${redis_args[@]}"
strip_redis_passwords() {
  redis_args=()
  local url
  while [ $# -gt 0 ]; do
    case $1 in
      --redis)
        shift
        if [ $# -eq 0 ]; then
          redis_args+=(--redis)  # strata says what is missing
          break
        fi
        url=$1
        shift
        ;;
      --redis=*)
        url=${1#--redis=}
        shift
        ;;
      *)
        redis_args+=("$1")
        shift
        continue
        ;;
    esac
    # redis://[user]:password@host...: the part up to the last '@', split at the first ':'
    # (as strata parses it).
    local rest=${url#redis://} auth user
    if [ "$rest" != "$url" ] && [ "${rest%@*}" != "$rest" ]; then
      auth=${rest%@*}
      if [ "${auth#*:}" != "$auth" ]; then
        export STRATA_REDIS_PASSWORD="${auth#*:}"
        user=${auth%%:*}
        url="redis://${user:+$user@}${rest##*@}"
      fi
    fi
    redis_args+=("--redis" "$url")
  done
}
