# What travels between device calls, sourced by device_call.sh (and by tests/benchmarks/test_device_transfer.py):
#   E3Q  the race's work folder (default /tmp/e3q, kept between calls on one warm machine)
#   OUT  the folder the device tool brings back: at most 8 files, 16 MiB each
#   log  the call's log file
#   CARRIED  the carried folder of inductor pieces (default .inductor)
# The inductor cache (both systems' compiled graphs: speculators' since the fourth session, ours' since the tenth)
# travels as inductor.tgz.part-* in .inductor/ (carry [".whl", ".inductor"]) and comes back, whole, in pieces of
# 15 MiB when a call compiled graphs the carried pieces lack: at most 3 pieces (45 MiB), as a call carries 64 MiB
# with the repo (8.2 MB in the tenth session) and .whl (6.4 MB).
E3Q=${E3Q:-/tmp/e3q}
CARRIED=${CARRIED:-.inductor}
PIECE_BYTES=${PIECE_BYTES:-$((15 * 1024 * 1024))}  # a test sets smaller pieces
MAX_PIECES=3
MAX_FILES=8

inductor_unpack() {  # the carried pieces into $E3Q/inductor, once per machine; how many files they held
  [ ! -d "$E3Q/inductor" ] || return 0
  if ! ls "$CARRIED"/inductor.tgz.part-* >/dev/null 2>&1; then  # logged: a cold start costs the race's call 1 ~370 s
    echo "no carried inductor cache ($CARRIED/inductor.tgz.part-*): both systems compile cold; keep a call's" \
      "returned pieces in .inductor/ and carry it" | tee -a "$log"
    return 0
  fi
  # unpacked aside, counted, then moved in whole: a call cut at any point (its limit, a lost piece) leaves no cache
  # that a later call would take as carried without its count and send back as new
  local tmp="$E3Q/inductor.unpacking"
  rm -rf "$tmp" && mkdir -p "$tmp" && cat "$CARRIED"/inductor.tgz.part-* | tar -xz -C "$tmp" \
    && find "$tmp/inductor" -type f | wc -l >"$E3Q/inductor.carried" && mv "$tmp/inductor" "$E3Q/inductor" || {
    echo "carried inductor cache unreadable: starting without it" | tee -a "$log"
    rm -rf "$tmp" "$E3Q/inductor.carried"; return 0; }
  rm -rf "$tmp"
  echo "carried inductor cache unpacked: $(du -sh "$E3Q/inductor" | cut -f1)" | tee -a "$log"
}

inductor_back() {  # the whole cache into $OUT when it holds more files than the pieces carried (or last sent) did
  [ -d "$E3Q/inductor" ] || return 0
  local files parts tgz="$E3Q/../inductor.tgz"
  files=$(find "$E3Q/inductor" -type f | wc -l)
  [ "$files" -gt "$(cat "$E3Q/inductor.carried" 2>/dev/null || echo 0)" ] || return 0
  tar -C "$E3Q" -czf "$tgz" inductor
  parts=$(( ($(stat -c %s "$tgz") + PIECE_BYTES - 1) / PIECE_BYTES ))
  echo "inductor cache: $(du -sh "$E3Q/inductor" | cut -f1), $files files, gzipped $(du -sh "$tgz" | cut -f1)" \
    | tee -a "$log"
  if [ "$parts" -gt "$MAX_PIECES" ]; then
    echo "inductor cache: $parts pieces of 15 MiB, over $MAX_PIECES: not brought back (a call carries 64 MiB)" \
      | tee -a "$log"
  elif [ $(( $(find "$OUT" -mindepth 1 -maxdepth 1 ! -name 'inductor.tgz.part-*' | wc -l) + parts )) -gt "$MAX_FILES" ]; then
    echo "inductor cache: no room in this call's $MAX_FILES files; a later call brings it back" | tee -a "$log"
  else  # an earlier send in this call (two device_call.sh runs in one) is replaced whole: no stale piece joins it
    rm -f "$OUT"/inductor.tgz.part-*
    split -b "$PIECE_BYTES" "$tgz" "$OUT/inductor.tgz.part-"
    echo "$files" >"$E3Q/inductor.carried"  # these pieces hold it: a later call sends back only a larger cache
  fi
  rm -f "$tgz"
}

points_back() {  # every evaluated point's per-prompt rows, the race's and each sweep setting's (run_quality --setting
  # keeps them in sweep/<name>/curve/), as one file (a call brings back 8 files at most), for `summarize.py paired`
  # here: two settings' paired ratio
  local dirs=() d
  for d in "$E3Q"/curve/* "$E3Q"/sweep/*/curve; do
    [ -d "$d" ] && dirs+=("${d#"$E3Q"/}")
  done
  # an earlier send in this call is replaced, so it takes no room of its own
  [ "${#dirs[@]}" -gt 0 ] && [ "$(find "$OUT" -mindepth 1 -maxdepth 1 ! -name curve_points.tgz | wc -l)" -lt "$MAX_FILES" ] \
    || return 0
  tar -C "$E3Q" -czf "$OUT/curve_points.tgz" "${dirs[@]}"
}
