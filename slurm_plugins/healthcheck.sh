#!/bin/bash
# unicorn HealthCheckProgram: run `unicorn-node-check` and drain this node on failure.
#
# Slurm (22.05) runs this every HealthCheckInterval with no arguments and an environment
# holding only SLURMD_NODENAME, and ignores its exit status: a failing check drains
# nothing by itself. So this script
#   - reads everything it needs from healthcheck.conf beside it (or $UNICORN_HEALTHCHECK_CONF):
#     KEY=VALUE lines, taken literally (never evaluated): NODE_CHECK (the unicorn-node-check
#     program), SCONTROL, TIMEOUT, TIMEOUT_S, SLURM_CONF, NODE_CHECK_ARG (repeatable, one
#     argument each), FAULT_DIR
#     (TEST ONLY: <FAULT_DIR>/<node>.jsonl is passed as --inject-gpu-faults), LOG_FILE;
#   - knows WHICH node it checks from SLURMD_NODENAME (set by slurmd; several slurmd may
#     share one host), else from its parent slurmd's `-N NAME`, else `hostname -s`;
#   - drains the node itself: scontrol update nodename=N state=drain reason="unicorn
#     healthcheck: <failed checks>", when unicorn-node-check reports the node unhealthy (exit 1
#     with an "unhealthy: ..." line) or does not finish within TIMEOUT_S;
#   - leaves a node that is already draining/drained alone (its reason, maybe an
#     operator's or unicornd's, is kept), and never resumes a node: returning a node is
#     the operator's or unicornd's decision (unicornd re-checks a node before reuse);
#   - does NOT drain when the check itself cannot run (missing or broken unicorn-node-check,
#     bad conf): a broken installation must not drain the whole cluster at once.
# Exit status: 0 healthy, 1 unhealthy (drained now or before), 2 the check could not run.

set -u
PATH=/usr/sbin:/usr/bin:/sbin:/bin
export PATH

conf=${UNICORN_HEALTHCHECK_CONF:-$(dirname -- "$0")/healthcheck.conf}
NODE_CHECK= SCONTROL= TIMEOUT= TIMEOUT_S=45 SLURM_CONF_PATH= FAULT_DIR= LOG_FILE=
check_args=()

say() {
	local line
	line="$(date -Is) unicorn-healthcheck ${node:-?}: $*"
	echo "$line" >&2
	if [[ -n $LOG_FILE ]]; then
		echo "$line" >>"$LOG_FILE" 2>/dev/null || true
	fi
}

broken() {
	say "cannot check: $*"
	exit 2
}

last300() { # the end of a long output (${x: -300} is empty when x is shorter)
	if ((${#1} > 300)); then echo "...${1: -300}"; else echo "$1"; fi
}

if [[ ! -r $conf ]]; then
	broken "no readable config $conf"
fi
while IFS= read -r line || [[ -n $line ]]; do
	[[ -z $line || $line == \#* ]] && continue
	if [[ $line != *=* ]]; then
		broken "$conf: not KEY=VALUE: $line"
	fi
	key=${line%%=*}
	value=${line#*=}
	case $key in
	NODE_CHECK) NODE_CHECK=$value ;;
	SCONTROL) SCONTROL=$value ;;
	TIMEOUT) TIMEOUT=$value ;;
	TIMEOUT_S) TIMEOUT_S=$value ;;
	SLURM_CONF) SLURM_CONF_PATH=$value ;;
	NODE_CHECK_ARG) check_args+=("$value") ;;
	FAULT_DIR) FAULT_DIR=$value ;;
	LOG_FILE) LOG_FILE=$value ;;
	*) broken "$conf: unknown key $key (valid: NODE_CHECK SCONTROL TIMEOUT TIMEOUT_S SLURM_CONF NODE_CHECK_ARG FAULT_DIR LOG_FILE)" ;;
	esac
done <"$conf"

for prog in "$NODE_CHECK" "$SCONTROL" "$TIMEOUT"; do
	if [[ $prog != /* || ! -x $prog ]]; then
		broken "$conf: '$prog' is not an absolute path to an executable"
	fi
done
if [[ ! $TIMEOUT_S =~ ^[1-9][0-9]?$ ]]; then
	broken "$conf: TIMEOUT_S must be 1..99 seconds, got '$TIMEOUT_S'"
fi
if [[ -n $SLURM_CONF_PATH ]]; then
	export SLURM_CONF=$SLURM_CONF_PATH
fi

# Which node: slurmd's own name for it, then the parent slurmd's -N, then the host name.
node=${SLURMD_NODENAME:-}
if [[ -z $node && -r /proc/$PPID/cmdline ]]; then
	mapfile -d '' parent_argv </proc/$PPID/cmdline
	for ((i = 0; i + 1 < ${#parent_argv[@]}; i++)); do
		if [[ ${parent_argv[i]} == -N ]]; then
			node=${parent_argv[i + 1]}
			break
		fi
	done
fi
if [[ -z $node ]]; then
	node=$(hostname -s)
fi
if [[ ! $node =~ ^[A-Za-z0-9._-]+$ ]]; then
	broken "node name '$node' is not a Slurm node name"
fi

fault_args=()
if [[ -n $FAULT_DIR ]]; then
	fault_args=(--inject-gpu-faults "$FAULT_DIR/$node.jsonl")
fi

# stderr of unicorn-node-check carries "unhealthy: <failed checks>"; its table (stdout) is dropped.
err=$({ "$TIMEOUT" -k 5 "$TIMEOUT_S" "$NODE_CHECK" "${check_args[@]}" "${fault_args[@]}" >/dev/null; } 2>&1)
rc=$?
case $rc in
0) exit 0 ;;
1)
	reason=$(grep -m1 '^unhealthy: ' <<<"$err")
	reason=${reason#unhealthy: }
	if [[ -z $reason ]]; then
		broken "unicorn-node-check failed without a verdict: $(last300 "$err")"
	fi
	;;
124 | 137) reason="node-check did not finish within ${TIMEOUT_S} s" ;;
*) broken "unicorn-node-check exited $rc: $(last300 "$err")" ;;
esac

reason="unicorn healthcheck: ${reason//$'\n'/; }"
reason=${reason:0:250}
if ! show=$("$SCONTROL" -o show node "$node" 2>&1); then
	broken "scontrol show node $node failed: $show"
fi
if [[ $show =~ (^|[[:space:]])State=[^[:space:]]*DRAIN ]]; then
	say "unhealthy, already draining/drained (reason kept): $reason"
	exit 1
fi
if ! out=$("$SCONTROL" update nodename="$node" state=drain reason="$reason" 2>&1); then
	broken "unhealthy but scontrol update failed: $out ($reason)"
fi
say "drained: $reason"
exit 1
