#!/usr/bin/env bash
# Benchmarks on a bandwidth-limited testbed: for each host count, N virtual hosts
# (network namespaces, slurm/testbed/netns.py) whose links are shaped to RATE in both directions,
# RANKS_PER_HOST ranks per host (default 1) started torchrun-style (a host is a node: its ranks talk over its
# loopback, unshaped), rank 0 of host 0 as the rendezvous. Prints the
# rows of `hpc bench allreduce` (KIND=allreduce) or of `hpc bench train --target-loss`
# (KIND=train: time to a held-out loss per codec against DDP; TRAIN_ARGS are that command's
# time-to-loss options, PLOT a PNG of the curves) and removes every namespace it made, also
# on failure or ^C. Traffic only ever uses the testbed's own addresses (SUBNET.0/24, and with NICS the
# next NICS-1 /24s).
#
#   slurm/testbed/bench.sh [HOSTS...]          default: 2 4
#   RATE=1gbit SIZES=64M CODECS=none,fp16,int8 ITERS=3 SUBNET=10.77.2 PREFIX=hpcbench
#   KIND=train CODECS=none,powersgd DDP=ddp,ddp-powersgd TRAIN_ARGS="--target-loss 2.5 --width 512" PLOT=x.png
#   RANKS_PER_HOST=2 SCOPES=flat,inter-node: ours also cut by node (parallel.compression_scope)
#   NICS=2: each host has 2 links, each shaped to RATE; a host's rank j talks on NIC j % NICS (a NIC per GPU)
#   OP=reduce-scatter: ZeRO-2/3's exchange instead of the all-reduce (KIND=allreduce)
set -euo pipefail

PYTHON=${PYTHON:-python3}
RATE=${RATE:-1gbit}
SIZES=${SIZES:-64M}
CODECS=${CODECS:-none,fp16,int8}
ITERS=${ITERS:-3}
SUBNET=${SUBNET:-10.77.2}
PREFIX=${PREFIX:-hpcbench}
MASTER_PORT=${MASTER_PORT:-29500}
KIND=${KIND:-allreduce}
DDP=${DDP:-ddp,ddp-powersgd}
TRAIN_ARGS=${TRAIN_ARGS:---target-loss 2.5}
PLOT=${PLOT:-}
RANKS_PER_HOST=${RANKS_PER_HOST:-1}
SCOPES=${SCOPES:-flat}
NICS=${NICS:-1}
OP=${OP:-allreduce}
HOSTS=("$@")
[[ $# -gt 0 ]] || HOSTS=(2 4)

netns() { "$PYTHON" -m slurm.testbed.netns --prefix "$PREFIX" "$@"; }
rank_options() {  # the options of `python -m jobs.bench.rank KIND` after --out
    if [[ $KIND == train ]]; then
        # shellcheck disable=SC2086  # TRAIN_ARGS is a list of options
        echo --transports torch --codecs "$CODECS" --scopes "$SCOPES" --ddp "$DDP" --steps 1 --warmup 0 --rounds 1 \
            $TRAIN_ARGS
    else
        echo --sizes "$SIZES" --codecs "$CODECS" --scopes "$SCOPES" --transports torch --iters "$ITERS" --op "$OP"
    fi
}
read -r -a options <<<"$(rank_options)"
scratch=$(mktemp -d /tmp/hpc-testbed-XXXXXX)
ranks=()
cleanup() {
    for pid in "${ranks[@]}"; do kill "$pid" 2>/dev/null || true; done
    netns destroy >/dev/null
    rm -rf "$scratch"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

for n in "${HOSTS[@]}"; do
    netns create "$n" --rate "$RATE" --subnet "$SUBNET" --nics "$NICS"
    rows="$scratch/rows-$n.json"
    ranks=()
    world=$((n * RANKS_PER_HOST))
    for ((i = 0; i < n; i++)); do
        for ((j = 0; j < RANKS_PER_HOST; j++)); do
            # Each host a node; exec sets GLOO_SOCKET_IFNAME to the rank's interface.
            RANK=$((i * RANKS_PER_HOST + j)) WORLD_SIZE=$world LOCAL_RANK=$j LOCAL_WORLD_SIZE=$RANKS_PER_HOST \
                GROUP_RANK=$i GROUP_WORLD_SIZE=$n MASTER_ADDR="$SUBNET.1" MASTER_PORT=$MASTER_PORT OMP_NUM_THREADS=1 \
                "$PYTHON" -m slurm.testbed.netns --prefix "$PREFIX" exec --nic $((j % NICS)) "$i" -- \
                "$PYTHON" -m jobs.bench.rank "$KIND" --out "$rows" "${options[@]}" &
            ranks+=($!)
        done
    done
    for pid in "${ranks[@]}"; do wait "$pid"; done
    ranks=()
    "$PYTHON" - "$rows" "$n" "$RATE" "$KIND" "$PLOT" <<'EOF'
import json, sys
from slurm.testbed.netns import rate_bits
rows, hosts, rate, kind, plot = sys.argv[1:]
rows = json.load(open(rows))
if kind == "train":
    from hpc.observe.plots import save_png
    from jobs.bench.time_to_loss import format_table, loss_curves_figure
    print(f"{hosts} hosts, every link {rate} in both directions")
    if plot:
        save_png(loss_curves_figure(rows), plot.replace(".png", f"-{hosts}.png"))
else:
    from jobs.bench.allreduce import format_table
    print(f"{hosts} hosts, every link {rate} in both directions: an uncompressed ring's busbw is at most "
          f"{rate_bits(rate) / 8e9:.3f} GB/s")
print(format_table(rows))
EOF
    netns destroy >/dev/null
done
