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
# (the race's and each kept sweep setting's), for `python benchmarks/quality/summarize.py paired A.json B.json`.
#
# Issue 21, one session (1,800 s of device time; the machine is usually an H100 even when an H200 is named),
# three calls back to back on one warm machine (carry [".whl", ".inductor"]; .inductor/ = the inductor.tgz.part-*
# pieces a call brings back: both systems' compiled graphs for these shapes). Ran as below on an H100 on 2026-12-05
# (fourth session; docs/benchmarks.md "Draft vocab 64,000 ... on one target"): 1,696 s of 1,800 with the machine's start.
#   1. bash benchmarks/quality/device_call.sh quality 575 target,spec_warm,prep,spec_data \
#        --draft-vocabs 64000,32768 --target-seconds 240 --train-steps 1000 --max-tokens 128
#        target 278 s (spec_warm beside it, 202 s with the cache carried), generate 147 s, vocab 6 s; the deadline cut
#        extract (it resumes).
#   2. ... quality 560 prep,spec_data,ours_v64000,spec_v64000,curve,plot (same flags)
#        extract's rest 32 s, spec_data 49 s, ours_v64000 152 s, speculators at 64,000 cut at step 761 (it resumes
#        from its end-of-epoch checkpoint, 253 steps an epoch).
#   3. ... quality 565 spec_v64000,ours_v32768,curve,plot (same flags)
#        speculators' last epoch 155 s, ours at 32,768 127 s (generate and extract adopted with --reuse-from), the
#        final points (21-65 s each), the 64,000 curve's step 200; 101 s of the session left.
#   Not yet on one target: speculators at 32,768 (~280 s) and the curves' intermediate points. All four cells with
#   final points alone need ~1,750 s (machine start ~118 s included): the whole session with no slack. Since then
#   the preflight imports no torch (each eagle3ctl call's start-up; unmeasured on the device) and prep runs vocab
#   and extract in one call. A plan for the four cells (same flags as above; no intermediate curve points):
#     1. quality 575 target,spec_warm,prep,spec_data        target 278, generate ~150, vocab + extract ~90
#     2. quality 590 spec_data,ours_v64000,spec_v64000,curve  ~50 + 152 + ~300 + the two final points
#     3. quality <rest> ours_v32768,spec_v32768,curve,plot    127 + ~280 + the two final points
#   Fifth session (2026-12-05), the greedy recipe: ours with train.teacher_temperature 0.25 against speculators with its
#   default kl_div and, as the control, its ce loss (cross-entropy on the target's argmax), at 32,768 on one target:
#     1. quality 575 target,spec_warm,prep,spec_data --draft-vocabs 32768 --sides ours,spec,specce \
#          --teacher-temperature 0.25 --target-seconds 240 --train-steps 1000 --max-tokens 128
#          (spec_warm compiles both of speculators' losses beside the target's training)
#     2. ... quality 585 spec_data,ours_v32768,spec_v32768,curve (same flags)
#     3. ... quality <rest> specce_v32768,curve,plot (same flags)
#   Ran on an H100: calls 1 (508 s) and 2 (542 s) as planned (ours 1.062x speculators' kl_div). The machine stopped
#   answering during call 3 (388 s of device time, nothing back): the ce control is still to run. Next: the same three
#   calls; then --teacher-temperature 0.1 --ttt-decay 0.6 (the CPU's best; --ttt-decay applies to both systems).
#   Sixth session (2026-12-05, H100): the same three calls, with specce_v32768 in call 2 and spec_v32768 in call 3
#   (498 + 496 + 349 s): ours 1.026x kl_div, 0.993x ce (docs/benchmarks.md "The control"). A fourth call on the warm
#   machine (375 s) retrained at --teacher-temperature 0.1 --ttt-decay 0.6: ce at decay 0.6 is valid, our final was the
#   replaced training's checkpoint (fixed in 20f8a9e). Next: that call again: ours_v32768,specce_v32768,curve,plot
#   after the three above (a retraining needs only its results/<step>.json removed).
#   Seventh session (2026-12-06, H100): those calls with --teacher-temperature 0.1 --ttt-decay 0.6 --eval-prompts 128
#   --eval-batch 128; three failed starts cost 466 s, so calls 1-2 raced --sides ours,specce (555 + 580 s budgets, 483
#   + 463 s used) and call 3 (325) trained spec_v32768 with the rest: ours 1.076x kl_div, 1.032x ce, both intervals
#   above 1.0 (docs/benchmarks.md "Every side at TTT decay 0.6").
#   Eighth session (2026-12-06, H100): the same flags with --sides ours,spec,specce in all three calls on a fresh target:
#     1. quality 575 target,spec_warm,prep,spec_data     528 s
#     2. quality 575 ours_v32768,specce_v32768,curve       510 s
#     3. quality 580 spec_v32768,curve,plot                353 s (every curve point; 274 s of the session left)
#   A tie: 0.999x kl_div, 0.987x ce (docs/benchmarks.md "The repeat on a fresh target"); ours moved 7 % between the
#   two targets, speculators' kl_div 0.3 %. Next: ours' lr and optimizer swept on one target, --optimizer muon being
#   speculators' default (docs/benchmarks.md "The optimizer"): call 1 as above; then per setting
#   rm -f /tmp/e3q/results/ours_v32768.json; bash benchmarks/quality/device_call.sh quality 280 ours_v32768,curve \
#     $FLAGS --lr 1e-3 --checkpoint-every 1000      (~135 s a setting: 95 s training, the final point)
#   Ninth session (2026-12-06, H100; two starts got none, the third took ~360 s): call 1 as above (550 s, spec_data cut),
#   then sweep 440 "adamw:5e-4 muon:1e-3 adamw:1.5e-3" (391 s: AdamW 4.201; Muon trained, held-out step-0 loss 0.531
#   against 0.609, its point cut) and quality 95 curve + quality 365 spec_data,spec_v32768,curve,plot at --optimizer muon
#   --lr 1e-3 (the point got 48 s of 95: each call spends ~30 s before the harness starts; speculators cut at step 865).
#   Next: docs/benchmarks.md "Ours' optimizer on the GPU" (the race at --optimizer muon --lr 1e-3, both sides).
#   Tenth session (2026-12-06, H100, start ~90 s): FLAGS as the ninth's with --sides ours,spec --checkpoint-every 1000:
#     1. quality 575 target,spec_warm,prep,spec_data $FLAGS                                    541 s (spec_data cut)
#     2. quality 575 spec_data,ours_v32768,spec_v32768,curve,plot $FLAGS --optimizer muon --lr 1e-3   520 s
#     3. quality 185 curve,plot (same) ; sweep 370 "muon:1e-3 adamw:5e-4" $FLAGS   in one device call, 360 s
#   Muon race: ours 4.498, speculators 4.412: 1.019x [0.979, 1.062], a tie; ours AdamW on that target 4.285
#   (docs/benchmarks.md "Both at speculators' default optimizer"). 259 s of the session left, given back.
#   Eleventh session (2026-12-06, H100, quick start): call 1 as the tenth's (485 s), then sweep 560 "muon:1e-3 muon:2e-3
#   muon:4e-3" (359 s: 4.657, 4.766, 4.749), then per lr (2e-3, 4e-3, 1e-3) sweep 30 "restore:muon_<lr>";
#   quality <budget> spec_v32768,curve,plot $FLAGS --optimizer muon --lr <lr> [--retrain] (302, 293, 210 s): speculators
#   5.082 at 2e-3 (ours 0.938x), 4.922 at 4e-3 (0.965x), 1e-3's point cut (docs/benchmarks.md "Muon's learning rate").
#   Next: that section's plan (sweep settings with ours' flags: muon:2e-3:lm-head=target-frozen ...).
#   Twelfth session (2026-12-06, H100; a new checkout: .whl refetched, no inductor cache, so spec_warm took 415 s and
#   call 1 cut extract): call 1 as above (559 s); quality 260 prep,spec_data then sweep "muon:2e-3
#   muon:2e-3:lm-head=target-frozen ..." in one call (464 s: 4.602, 4.856); restore the frozen one, race speculators at
#   2e-3 (1.024x), then sweep "muon:4e-3:lm-head=target-frozen" in one call (501 s: 4.704) (docs/benchmarks.md "The
#   frozen draft head"). Next: that section's plan (the frozen head with the other settings; race:<setting> in a sweep
#   now restores a kept setting and races speculators at its recipe in one step).
#   Thirteenth session (2026-12-06, H100, cold cache again): call 1 as above (561 s); quality 260 prep,spec_data then
#   sweep "muon:2e-3:lm-head=target-frozen muon:2e-3:adamw-lr=2e-4 ..." in one call (531 s: 5.114, 5.035); sweep 550
#   "race:muon_2e-3_lm-head-target-frozen $S" (516 s: 5.060, 5.111, 5.034; the race skipped: race: takes the setting,
#   muon:2e-3:lm-head=target-frozen, and now refuses a kept name). Next: docs/benchmarks.md "Ours' settings around the
#   frozen head" (the race in quality's own steps in call 2, then two settings).
#   Fourteenth session (2026-12-06, H100, cold cache): that plan as written (492 s, all four steps this time; 414 s:
#   the race, 1.029x [1.003, 1.057]; sweep 575 of three settings, 391 s), then sweep 320 of two more (262 s). Next:
#   docs/benchmarks.md "The race at the frozen head" (the race at --teacher-temperature 0.03, T 0.1 as the control).
#   Disk: the hidden states exist twice (ours 5,125 B/token + speculators' copy: ~47 GB at 4.6M tokens); the other
#   vocabs' runs adopt ours with --reuse-from (hard links), no third copy.
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
  python3 benchmarks/quality/run_quality.py --work "$E3Q" --out "$OUT" --budget-s "$(( $(left) - 15 ))" --steps "$steps" "$@" \
    2>&1 | tee -a "$log"
  cp "$E3Q/target_meta.json" "$OUT/" 2>/dev/null
  inductor_back
  points_back
elif [ "$mode" = sweep ]; then
  # Ours' optimizer and lr (and any of ours' own run_quality flags) on the target call 1 made (ours_v*,curve per
  # setting, the final point alone), and speculators raced against a kept one:
  #   sweep BUDGET_S "adamw:5e-4 muon:2e-3:lm-head=target-frozen race:muon:2e-3:lm-head=target-frozen" FLAGS
  # A setting is optimizer:lr, then flag=value pieces passed as --flag value; its name joins them with _ (= as -):
  # muon_2e-3_lm-head-target-frozen. Each setting's training and final point are kept in /tmp/e3q/sweep/<name> and
  # its summary in $OUT/sweep_<name>.json; a setting kept already is not trained again.
  # restore:<name> puts one back as ours' result. race:<setting> puts a kept setting back and races speculators'
  # kl_div side (spec) against it at the setting's optimizer, lr and ours' flags (a speculators training of another
  # recipe is trained again), evaluates every curve point and plots: $OUT/race_<name>.json and race_<name>.png.
  settings=$3
  shift 3
  kept_dirs="snapshots curve recipes results"  # what a setting keeps of ours' training; results/ last: its done marker
  setting() {  # opt, lr, extra (ours' flags) and name of the setting opt:lr[:flag=value...]; 1 if malformed
    IFS=: read -ra pieces <<< "$1"
    opt=${pieces[0]}; lr=${pieces[1]}; name=${opt}_$lr; extra=()
    # a kept name (muon_2e-3_...) where a setting belongs parsed as an optimizer with no lr: refused, not skipped
    # (the form only: what an optimizer, lr or flag may be is run_quality's to say, in check() below)
    if [[ ! $opt =~ ^[a-z]+$ || ! $lr =~ ^[0-9.]+(e-?[0-9]+)?$ ]]; then
      echo "sweep: $1 is not OPTIMIZER:LR[:flag=value...] (race: takes the setting; restore: the kept name)" \
        | tee -a "$log"; return 1
    fi
    for kv in "${pieces[@]:2}"; do
      [[ $kv == *=* ]] || { echo "sweep: $kv in $1 is not flag=value" | tee -a "$log"; return 1; }
      extra+=("--${kv%%=*}" "${kv#*=}"); name=${name}_${kv//=/-}
    done
  }
  restore() {  # the kept setting $1 as ours' result again; the done marker goes first and comes back last, so a
    # kill or a failed copy midway leaves ours untrained, not half restored
    local st=$E3Q/sweep/$1 d
    [ -d "$st" ] || { echo "sweep: nothing kept as $1" | tee -a "$log"; return 1; }
    rm -rf "$E3Q/results"/ours[-_]v*
    for d in $kept_dirs; do
      rm -rf "$E3Q/$d"/ours[-_]v*
      mkdir -p "$E3Q/$d" && cp -a "$st/$d/." "$E3Q/$d/" || { echo "sweep: restoring $1 failed at $d/" | tee -a "$log"; return 1; }
    done
    echo "sweep: ours is the $1 training again" | tee -a "$log"
  }
  keep() {  # ours' training as the kept setting $1: copied whole, then named, so a kill or a failed copy (a full
    # disk) mid-way leaves no half setting for restore: and race: to trust
    local st=$E3Q/sweep/$1 d
    rm -rf "$st.part"
    for d in $kept_dirs; do
      mkdir -p "$st.part/$d" && cp -a "$E3Q/$d"/ours[-_]v* "$st.part/$d/" \
        || { rm -rf "$st.part"; echo "sweep: keeping $1 failed at $d/: not kept" | tee -a "$log"; return 1; }
    done
    mv "$st.part" "$st" \
      || { rm -rf "$st.part"; echo "sweep: keeping $1 failed at the rename: not kept" | tee -a "$log"; return 1; }
  }
  check() {  # setting $1's flags as run_quality reads them (the optimizer's choices, the train stage's bounds, no
    # flag it lacks), nothing run: one line that quotes run_quality's and 1 if refused
    local said
    said=$(python3 benchmarks/quality/run_quality.py --work "$E3Q" --out "$OUT" --steps "$2" "${@:3}" \
      --optimizer "$opt" --lr "$lr" "${extra[@]}" --check 2>&1) \
      || { echo "sweep: $1 refused: ${said##*$'\n'}" | tee -a "$log"; return 1; }
  }
  for s in $settings; do  # every setting checked before any trains: a typo in the last must not end a sweep midway
    case $s in
      restore:*) ;;
      race:*) setting "${s#race:}" && check "${s#race:}" spec_data,spec,curve,plot "$@" || exit 1 ;;
      *) setting "$s" && check "$s" ours,curve "$@" || exit 1 ;;
    esac
  done
  for s in $settings; do
    if [[ $s == restore:* ]]; then restore "${s#restore:}" || exit 1; continue; fi
    if [[ $s == race:* ]]; then
      setting "${s#race:}"
      if [ ! -d "$E3Q/sweep/$name" ]; then echo "sweep: $name not kept: no race against it" | tee -a "$log"; continue; fi
      if [ "$(left)" -lt 160 ]; then echo "sweep: $(left) s left; race:$name next call" | tee -a "$log"; break; fi
      restore "$name" || exit 1
      rm -f "$OUT/quality_race.json" "$OUT/acceptance_vs_steps.png"  # an earlier report must not speak for this race
      python3 benchmarks/quality/run_quality.py --work "$E3Q" --out "$OUT" --budget-s "$(( $(left) - 15 ))" \
        --steps spec_data,spec,curve,plot "$@" --optimizer "$opt" --lr "$lr" "${extra[@]}" --retrain 2>&1 | tee -a "$log"
      [ -f "$OUT/quality_race.json" ] && mv "$OUT/quality_race.json" "$OUT/race_$name.json"
      [ -f "$OUT/acceptance_vs_steps.png" ] && mv "$OUT/acceptance_vs_steps.png" "$OUT/race_$name.png"
      echo "sweep: speculators raced against $name: race_$name.json" | tee -a "$log"
      continue
    fi
    setting "$s"
    st=$E3Q/sweep/$name
    if [ -d "$st" ]; then echo "sweep: $name kept earlier" | tee -a "$log"; continue; fi
    if [ "$(left)" -lt 160 ]; then echo "sweep: $(left) s left; $name next call" | tee -a "$log"; break; fi
    # --retrain: the previous setting's training is trained again; one of this setting whose final point a
    # deadline cut is kept and evaluated
    rm -f "$OUT/quality_race.json"  # the previous setting's report must not speak for this one
    python3 benchmarks/quality/run_quality.py --work "$E3Q" --out "$OUT" --budget-s "$(( $(left) - 15 ))" \
      --steps ours,curve "$@" --optimizer "$opt" --lr "$lr" "${extra[@]}" --checkpoint-every 1000 --retrain 2>&1 \
      | tee -a "$log"
    # kept only when this call's report says ours trained (or was kept) and its final point was evaluated: a
    # skipped or cut retraining leaves the previous setting's result in place, not this one's
    if [ -f "$OUT/quality_race.json" ] && python3 benchmarks/quality/summarize.py ours-finished "$OUT/quality_race.json" \
        && keep "$name"; then
      cp "$OUT/quality_race.json" "$OUT/sweep_$name.json"
      echo "sweep: $name kept" | tee -a "$log"
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
