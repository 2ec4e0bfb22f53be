# Sourced by the experiments that compare configs over seeds: `train_seeds OUT NAME...` trains
# OUT/NAME.toml once per seed of $SEEDS (default 1337 1338 1339) with $ember, each run in
# OUT/run-NAME-SEED and its log in OUT/NAME-SEED.log, alternating the configs within each seed.
train_seeds() {
  local out=$1 seed name
  shift
  for seed in ${SEEDS:-1337 1338 1339}; do
    for name in "$@"; do
      sed -i "s/^seed = .*/seed = $seed/" "$out/$name.toml"
      rm -rf "$out/run-$name-$seed"
      "$ember" train --config "$out/$name.toml" --run-dir "$out/run-$name-$seed" --no-progress > "$out/$name-$seed.log" 2>&1
      echo "$name $seed done"
    done
  done
}
