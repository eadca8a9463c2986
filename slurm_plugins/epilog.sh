#!/bin/bash
# unicorn Epilog: free a finished job's checkpoint memory tier on this node.
#
# Ranks snapshot into <shm_dir>/snap/<scope>.<job> and agents keep their ring
# predecessors' copies in <shm_dir>/peer/<scope>.<job> (a tmpfs: node RAM). Both only
# serve restores *within* the job, so once the job has ended on this node they are dead
# weight: without this script every job left its last snapshots in RAM for good.
#
# slurmd runs this (as SlurmdUser, normally root) on every node of a job when the job ends
# there, with SLURM_JOB_ID in the environment. Everything else comes from epilog.conf
# beside it (or $UNICORN_EPILOG_CONF): KEY=VALUE lines, taken literally: SHM_DIR
# (repeatable: every memory-tier root of this node), SCONTROL, TIMEOUT, SLURM_CONF,
# LOG_FILE.
#
# - Only this job's folders go: names "<job>" or "*.<job>" directly under snap/ and
#   peer/ (the scope is the installation's key prefix; job ids are unique per
#   slurmctld, so every scope's folder for this id is this job's). Symlinks are never
#   followed.
# - A requeued job runs again under the same id, and its new ranks restore from this
#   memory first: when folders exist, the script asks slurmctld once (scontrol, 10 s
#   limit) and keeps them if the job is PENDING (or REQUEUE*) again. If that question fails, they go
#   (the durable tiers still hold the job's checkpoints).
# - It always exits 0: Slurm drains a node whose Epilog fails, and a cleanup problem is
#   no reason to take a node out of service. What it did or could not do goes to
#   LOG_FILE and stderr (slurmd's log).

set -u
PATH=/usr/sbin:/usr/bin:/sbin:/bin
export PATH

conf=${UNICORN_EPILOG_CONF:-$(dirname -- "$0")/epilog.conf}
SCONTROL= TIMEOUT= SLURM_CONF_PATH= LOG_FILE=
shm_dirs=()
job=${SLURM_JOB_ID:-}

say() {
	local line
	line="$(date -Is) unicorn-epilog job ${job:-?}: $*"
	echo "$line" >&2
	if [[ -n $LOG_FILE ]]; then
		echo "$line" >>"$LOG_FILE" 2>/dev/null || true
	fi
}

if [[ ! -r $conf ]]; then
	say "no readable config $conf; nothing removed"
	exit 0
fi
while IFS= read -r line || [[ -n $line ]]; do
	[[ -z $line || $line == \#* ]] && continue
	key=${line%%=*}
	value=${line#*=}
	case $key in
	SHM_DIR) shm_dirs+=("$value") ;;
	SCONTROL) SCONTROL=$value ;;
	TIMEOUT) TIMEOUT=$value ;;
	SLURM_CONF) SLURM_CONF_PATH=$value ;;
	LOG_FILE) LOG_FILE=$value ;;
	*)
		say "$conf: unknown key '$key' (valid: SHM_DIR SCONTROL TIMEOUT SLURM_CONF LOG_FILE); nothing removed"
		exit 0
		;;
	esac
done <"$conf"

if [[ ! $job =~ ^[1-9][0-9]*$ ]]; then
	say "SLURM_JOB_ID '$job' is not a job id; nothing removed"
	exit 0
fi

folders=()
shopt -s nullglob
for root in "${shm_dirs[@]}"; do
	root=${root//\{node\}/${SLURMD_NODENAME:-}} # {node}: nodes sharing one machine keep apart tiers
	if [[ $root != /* ]]; then
		say "$conf: SHM_DIR '$root' is not an absolute path; skipped"
		continue
	fi
	for sub in snap peer; do
		for folder in "$root/$sub/$job" "$root/$sub/"*".$job"; do
			if [[ -d $folder && ! -L $folder ]]; then
				folders+=("$folder")
			fi
		done
	done
done
if ((${#folders[@]} == 0)); then
	exit 0
fi

if [[ -n $SLURM_CONF_PATH ]]; then
	export SLURM_CONF=$SLURM_CONF_PATH
fi
if [[ $SCONTROL == /* && -x $SCONTROL && $TIMEOUT == /* && -x $TIMEOUT ]]; then
	show=$("$TIMEOUT" -k 2 10 "$SCONTROL" -o show job "$job" 2>/dev/null)
	if [[ $show =~ (^|[[:space:]])JobState=(PENDING|REQUEUE[A-Z_]*)([[:space:]]|$) ]]; then
		say "requeued (${BASH_REMATCH[2]}): memory tier kept for its next run: ${folders[*]}"
		exit 0
	fi
fi

if err=$(rm -rf -- "${folders[@]}" 2>&1); then
	say "removed ${folders[*]}"
else
	say "could not remove everything: $err"
fi
exit 0
