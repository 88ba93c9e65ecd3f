#!/usr/bin/env bash
# How pyspy_pd_h100_summary.txt was taken (run from the repository root by bench/gpu_session.sh
# on a lent H100, with a py-spy wheel for Python 3.12 carried in .ab-mid/spy/).
pip install -q --no-index --no-deps --target /tmp/spy .ab-mid/spy/*.whl || exit 1
SPY=/tmp/spy/bin/py-spy
python3 -m bench.gpu_pd --tokenizer .device-assets/tokenizer --prompt-len 2048 --requests 12 --prefill-chunks 2048 \
    --redis-nodes 4 --pool-gb 1.5 --warmup 14 > $OUT/gpu_pd_spy.txt 2>&1 &
BENCH=$!
for i in $(seq 1 120); do
  D=$(pgrep -f -- "-m services.decode" | tail -1); P=$(pgrep -f -- "-m services.prefill" | tail -1)
  [ -n "$D" ] && [ -n "$P" ] && break; sleep 0.5
done
sleep 1
$SPY record -r 1000 -p $D -f raw -o $OUT/spy_decode.txt --threads --idle -d 40 --nonblocking > $OUT/spy_d.log 2>&1 &
$SPY record -r 1000 -p $P -f raw -o $OUT/spy_prefill.txt --threads --idle -d 40 --nonblocking > $OUT/spy_p.log 2>&1 &
wait $BENCH
wait
