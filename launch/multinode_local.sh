#!/bin/bash
# Two "nodes" on this machine: two separate `deepspeed --no_ssh --node_rank K` launches (2 ranks
# each) meet on 127.0.0.1 and train the 4-stage demo as one world of 4 ranks (the same launch as
# tests/test_multinode.py). Each node launch is its own process group; if either fails, or after
# TIMEOUT seconds, both groups are killed.
#   launch/multinode_local.sh [TIMEOUT]     (default 240 s; node logs in $LOG_DIR, default a temp dir)
set -u
cd "$(dirname "$0")/.."
TIMEOUT=${1:-240}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
LOG_DIR=${LOG_DIR:-$(mktemp -d)}
PORT=$(.venv/bin/python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
HOSTFILE="$LOG_DIR/hostfile"
printf 'node0 slots=2\nnode1 slots=2\n' > "$HOSTFILE"   # labels only: with --no_ssh nothing connects to them

set -m   # job control: every background job gets its own process group (pgid = its pid)
pids=()
for K in 0 1; do
    .venv/bin/deepspeed --hostfile "$HOSTFILE" --no_ssh --num_nodes 2 --node_rank "$K" --num_gpus 2 \
        --master_addr 127.0.0.1 --master_port "$PORT" \
        examples/multimodal_demo.py --deepspeed_config configs/example.json > "$LOG_DIR/node$K.log" 2>&1 &
    pids+=($!)
done
kill_groups() { for p in "${pids[@]}"; do kill -KILL -- "-$p" 2>/dev/null; done; }
trap 'kill_groups; exit 130' INT TERM

rcs=()
start=$SECONDS
while :; do
    running=0; failed=0
    for p in "${pids[@]}"; do
        if kill -0 "$p" 2>/dev/null; then running=1; fi
    done
    for i in 0 1; do
        if ! kill -0 "${pids[$i]}" 2>/dev/null && [ -z "${rcs[$i]:-}" ]; then
            wait "${pids[$i]}"; rcs[$i]=$?
            [ "${rcs[$i]}" -ne 0 ] && failed=1
        fi
    done
    [ "$running" -eq 0 ] && break
    if [ "$failed" -eq 1 ] || [ $((SECONDS - start)) -gt "$TIMEOUT" ]; then
        echo "node failed or timed out after $((SECONDS - start)) s: killing both nodes" >&2
        kill_groups; wait; break
    fi
    sleep 1
done
kill_groups   # ranks a launcher may have left behind
for K in 0 1; do echo "=== node $K (rc ${rcs[$K]:-killed}): $LOG_DIR/node$K.log"; tail -n 4 "$LOG_DIR/node$K.log"; done
grep -q "pipelined losses EQUAL the single-device run" "$LOG_DIR/node0.log" && [ "${rcs[0]:-1}" = 0 ] && [ "${rcs[1]:-1}" = 0 ]
