#!/usr/bin/env bash
# One call on the lent H200 (device tool; repo root is the cwd, $OUT comes back).
#   bash benchmarks/quality/device_call.sh quality BUDGET_S [STEPS [FLAGS]]  # issue 21's race (resumable in /tmp/e3q)
#   bash benchmarks/quality/device_call.sh sweep BUDGET_S "SETTINGS" [FLAGS] # ours' settings on one target; race: one
#   bash benchmarks/quality/device_call.sh benches BUDGET_S               # issue 3: bench_extract + bench_train (8B + quality shape)
#   bash benchmarks/quality/device_call.sh extract [LIMIT_S]              # issue 3: bench_extract alone (~250 s)
#   bash benchmarks/quality/device_call.sh cuda-tests [LIMIT_S]           # tests/cuda on the GPU
#   bash benchmarks/quality/device_call.sh train-quality [LIMIT_S]        # bench_train at the race's shape, profiled
#
# quality: STEPS (default all) and FLAGS go to run_quality.py. Every step is resumable: a step the
# budget cuts (generate, extract, either training, the curve) carries on in the next call on the
# same warm machine (/tmp/e3q persists between consecutive calls; a fresh machine starts over).
# $OUT: device_log.txt, quality_race.json (summary + curve points), acceptance_vs_steps.png,
# target_meta.json, the inductor cache as inductor.tgz.part-* when the call compiled new graphs (put those in
# .inductor/, replacing what is there, and carry [".whl", ".inductor"] to start a later machine warm), and, while
# fewer than the 8 files a call brings back are there, curve_points.tgz: every evaluated point's per-prompt rows
# (the race's and each sweep setting's), for `python benchmarks/quality/summarize.py paired A.json B.json`.
#
# Issue 21, one session (1,800 s of device time; the machine is usually an H100 even when an H200 is named): three or
# four calls back to back on one warm machine, each carrying [".whl", ".inductor"]. Whenever a call brings back
# inductor.tgz.part-* pieces (both systems' compiled graphs for these shapes), put them in .inductor/ at once,
# replacing what is there: the checkout here has outlived sessions since 2026-12-06, and a session that starts with
# the cache saves ~370 s of speculators' compile in call 1 (a call with nothing carried logs "no carried inductor
# cache"). A new checkout has neither folder: fetch_wheels.sh first; the cache then comes back from call 1.
# The inductor cache is keyed by the card's name: pieces from an H100 spare an H200 only triton's kernels.
# The machine is released after 30 s idle and /tmp/e3q with it: make the calls at once.
# A start that fails costs 90 s of device time per kind tried (two when no kind or nvidia-h200 is named;
# nvidia-h100-x1: one).
# The race at 1,000 steps a side needs ~1,100 s with the start when the cache is cold (sixteenth session: ~30 +
# 512 + 443 s, then ~90 s for the two final points), ~1,030 s warm (nineteenth: call 1 545 device s with the start,
# the race with --checkpoint-every 500 484 device s); at 500 steps a side (pass --train-steps 500
# --checkpoint-every 500) ~900 s warm. Below ~900 s stop asking (a race cut before its curve reports nothing), and
# ask each call for all that is left. Cold in a new checkout (twentieth session): call 1 556 device s with the start,
# and the race at equal training seconds (--ours-train-steps 3000: ours 3,000 steps, speculators 1,000) 545 for 4 of
# its 5 points; a speculators side retrained at --train-steps 300 with its curve ~212.
# A typical session (fourteenth, 2026-12-06, H100, cold cache; FLAGS, R and the sweep's settings as written there):
#   1. quality 575 target,spec_warm,prep,spec_data $FLAGS                      ~490-560 s (a cold cache may cut extract)
#   2. quality 560 prep,spec_data,ours_v32768,spec_v32768,curve,plot $FLAGS $R   ~410 s: the race
#   3. sweep <rest> "SETTINGS" $FLAGS                                           ~130 s a setting (training + final point)
# Each session's commands, timings, results and the next session's plan: docs/benchmarks.md, newest first, under
# "Issue 21" (this header once kept that log too).
# Disk: the hidden states exist twice (ours 5,125 B/token + speculators' copy: ~47 GB at 4.6M tokens); the other
# vocabs' runs adopt ours with --reuse-from (hard links), no third copy.
# Several modes may follow each other in one call; each writes into $OUT and appends to $OUT/device_log.txt.
# Missing Python packages travel as wheels in .whl/ (made here by fetch_wheels.sh; carry: [".whl"]) and go to /tmp/site.
set -o pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true
t0=$(date +%s)
if [ ! -d /tmp/site/speculators ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || {
    # .whl/ is git-ignored: a new checkout has none until fetch_wheels.sh makes it
    echo "device_call: installing .whl/ failed: run bash benchmarks/quality/fetch_wheels.sh, carry [\".whl\"]" >&2
    exit 1; }
fi
export PYTHONPATH=/tmp/site:$PWD
mode=$1; budget=${2:-540}
log="$OUT/device_log.txt"
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader | tee -a "$log"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$log"
left() { echo $(( budget - ($(date +%s) - t0) )); }
# shellcheck source=benchmarks/quality/device_transfer.sh
. benchmarks/quality/device_transfer.sh  # what travels between calls: the inductor cache, the points' rows
case $mode in quality|sweep) inductor_unpack ;; esac  # the race's modes compile; the others need no cache
if [ "$mode" = quality ]; then
  steps="${3:-all}"
  shift $(( $# < 3 ? $# : 3 ))
  rm -f "$OUT/quality_race.json"  # an earlier mode's report in this call must not speak for this run
  python3 benchmarks/quality/run_quality.py --work "$E3Q" --out "$OUT" --budget-s "$(( $(left) - 15 ))" --steps "$steps" "$@" \
    2>&1 | tee -a "$log"
  cp "$E3Q/target_meta.json" "$OUT/" 2>/dev/null
  inductor_back
  points_back
elif [ "$mode" = sweep ]; then
  # Ours' optimizer and lr (and any of ours' own run_quality flags) on the target call 1 made (ours_v*,curve per
  # setting, the final point alone), and speculators raced against a finished one:
  #   sweep BUDGET_S "adamw:5e-4 muon:2e-3:lm-head=target-frozen race:muon:2e-3:lm-head=target-frozen" FLAGS
  # A setting is optimizer:lr, then flag=value pieces passed as --flag value; its name joins them with _ (= as -):
  # muon_2e-3_lm-head-target-frozen. Each setting trains in a folder and runs of its own (run_quality --setting:
  # /tmp/e3q/sweep/<name>, runs q-vV-<hash>), so nothing of the race's is retrained or replaced; its summary comes
  # back as $OUT/sweep_<name>.json. A setting whose training and final point finished is marked so (finished.json
  # in its folder) and not run again; a cut one resumes in its folder on the next call.
  # race:<setting> races speculators' kl_div side (spec) against a finished setting, in the setting's folder, at its
  # optimizer, lr and ours' flags, evaluates every curve point and plots: $OUT/race_<name>.json and race_<name>.png.
  settings=$3
  shift 3
  flags=("$@")  # the race's flags, every setting's before its own
  race_run=(spec_data,spec,curve,plot --retrain)              # race:'s steps, then what follows the setting's flags
  setting_run=(ours,curve --checkpoint-every 1000 --retrain)  # a setting's: its training and final point
  setting() {  # opt, lr, extra (ours' flags) and name of the setting opt:lr[:flag=value...]; 1 if malformed
    IFS=: read -ra pieces <<< "$1"
    opt=${pieces[0]}; lr=${pieces[1]}; name=${opt}_$lr; extra=()
    # a setting's name (muon_2e-3_...) where a setting belongs parsed as an optimizer with no lr: refused, not skipped
    # (the form only: what an optimizer, lr or flag may be is run_quality's to say, in check() below)
    if [[ ! $opt =~ ^[a-z]+$ || ! $lr =~ ^[0-9.]+(e-?[0-9]+)?$ ]]; then
      echo "sweep: $1 is not OPTIMIZER:LR[:flag=value...] (race: takes the setting, not its name)" | tee -a "$log"
      return 1
    fi
    for kv in "${pieces[@]:2}"; do
      [[ $kv == *=* ]] || { echo "sweep: $kv in $1 is not flag=value" | tee -a "$log"; return 1; }
      extra+=("--${kv%%=*}" "${kv#*=}"); name=${name}_${kv//=/-}
    done
  }
  harness() {  # run_quality at the setting in $opt, $lr, $extra, $name: $1 the budget (empty: none), $2 the steps,
    # then the rest
    local budget=$1 steps=$2
    shift 2
    python3 benchmarks/quality/run_quality.py --work "$E3Q" --out "$OUT" ${budget:+--budget-s "$budget"} --steps "$steps" \
      "${flags[@]}" --optimizer "$opt" --lr "$lr" "${extra[@]}" --setting "$name" "$@"
  }
  check() {  # setting $1 run as ${@:2} would run it, read by run_quality (the optimizer's choices, the train stage's
    # bounds, no flag it lacks) and nothing run: one line that quotes run_quality's and 1 if refused
    local said
    said=$(harness "" "${@:2}" --check 2>&1) || { echo "sweep: $1 refused: ${said##*$'\n'}" | tee -a "$log"; return 1; }
  }
  for s in $settings; do  # every setting checked before any trains: a typo in the last must not end a sweep midway
    case $s in
      race:*) setting "${s#race:}" && check "${s#race:}" "${race_run[@]}" || exit 1 ;;
      *) setting "$s" && check "$s" "${setting_run[@]}" || exit 1 ;;
    esac
  done
  for s in $settings; do
    setting "${s#race:}"
    finished=$E3Q/sweep/$name/finished.json  # the setting's report when its training and final point finished
    if [[ $s == race:* ]]; then
      if [ ! -f "$finished" ]; then echo "sweep: $name not finished: no race against it" | tee -a "$log"; continue; fi
      if [ "$(left)" -lt 160 ]; then echo "sweep: $(left) s left; race:$name next call" | tee -a "$log"; break; fi
      rm -f "$OUT/quality_race.json" "$OUT/acceptance_vs_steps.png"  # an earlier report must not speak for this race
      harness "$(( $(left) - 15 ))" "${race_run[@]}" 2>&1 | tee -a "$log"
      [ -f "$OUT/quality_race.json" ] && mv "$OUT/quality_race.json" "$OUT/race_$name.json"
      [ -f "$OUT/acceptance_vs_steps.png" ] && mv "$OUT/acceptance_vs_steps.png" "$OUT/race_$name.png"
      echo "sweep: speculators raced against $name: race_$name.json" | tee -a "$log"
      continue
    fi
    if [ -f "$finished" ]; then echo "sweep: $name finished earlier" | tee -a "$log"; continue; fi
    if [ "$(left)" -lt 160 ]; then echo "sweep: $(left) s left; $name next call" | tee -a "$log"; break; fi
    rm -f "$OUT/quality_race.json"  # the previous setting's report must not speak for this one
    harness "$(( $(left) - 15 ))" "${setting_run[@]}" 2>&1 | tee -a "$log"
    # finished only when this call's report says ours trained (or had) and its final point was evaluated; written
    # whole (a copy, then a rename), so a kill mid-write leaves no mark of a setting that is not all there
    if [ -f "$OUT/quality_race.json" ] && python3 benchmarks/quality/summarize.py ours-finished "$OUT/quality_race.json" \
        && cp "$OUT/quality_race.json" "$finished.part" && mv "$finished.part" "$finished"; then
      mv "$OUT/quality_race.json" "$OUT/sweep_$name.json"
      echo "sweep: $name finished" | tee -a "$log"
    fi
  done
  points_back  # the sweep's purpose first: the cache comes back from a later call if no room is left here
  inductor_back
elif [ "$mode" = cuda-tests ]; then  # tests/cuda: compiled training, batched decoding, the train stage on CUDA
  timeout "${2:-300}" python3 -m pytest -q -p no:cacheprovider tests/cuda 2>&1 | tee -a "$log"
elif [ "$mode" = train-quality ]; then  # the race's drafter shape, no target needed: where a training step's time goes
  timeout "${2:-200}" python3 benchmarks/bench_train.py --shape quality --batch 8 --counted 0.4 --attention flex --packed \
    --profile --out "$OUT/train_quality_h200.json" 2>&1 | tee -a "$log"
elif [ "$mode" = extract ]; then  # issue 3's extraction benchmark alone
  timeout "${2:-260}" python3 benchmarks/bench_extract.py --out "$OUT/extract_h200.json" 2>&1 | tee -a "$log"
elif [ "$mode" = benches ]; then
  # Fixed limits per benchmark, extraction first: in the 2nd session's call the two training
  # benchmarks (8B compile) used the whole budget and extraction got 20 s.
  timeout 200 python3 benchmarks/bench_extract.py --out "$OUT/extract_h200.json" 2>&1 | tee -a "$log"
  timeout 170 python3 benchmarks/bench_train.py --attention flex --out "$OUT/train_h200.json" 2>&1 | tee -a "$log"
  timeout 120 python3 benchmarks/bench_train.py --shape quality --batch 8 --counted 0.4 --attention flex --packed --profile \
    --out "$OUT/train_quality_h200.json" 2>&1 | tee -a "$log"
fi
echo "device_call $mode done in $(( $(date +%s) - t0 ))s" | tee -a "$log"
