#!/bin/bash
# One device-machine call of a GPU session (benchmarks/README.md):
#   DEADLINE=570 bash benchmarks/scripts/device_session.sh STEP...   (run from the repository root, `.deps` carried)
# steps: smi (the GPU's clocks, power and throttle reasons sampled every 200 ms from here on, into smi.csv in bench.tgz) |
# setup (install hf_apex; apex from .deps/apex-prebuilt when there, else built, only the extensions hf_apex
# loads, unless its kernels are there) |
# apexpack (the installed apex into $OUT/apex-prebuilt.tgz.part-*, 15 MiB parts: move them into .deps/apex-prebuilt/
# to skip the build next session; never commit them; a CPU machine with nvcc 13.0 can build the same, no GPU needed:
# a Python 3.12 venv with torch==2.11.0 (PyPI's, CUDA 13.0; --no-deps), transformers 5.17 and accelerate 1.15, then
# CPATH=<a site-packages with torch's nvidia/cu13/include, e.g. .deps/venv-lowest's> TORCH_CUDA_ARCH_LIST=9.0
# PYTHONPATH=. python -m hf_apex.build_apex --commit <the Makefile's APEX_COMMIT> --src .deps/apex --extensions hf_apex,
# and the files apexpack names, tarred from that venv's site-packages and split alike; 22 min on 2 busy cores,
# 2026-12-08; not yet loaded on a GPU) | testgpu (make test-gpu) | testgpuslow (make test-gpu-slow: the long loss-curve
# tests) | fast (tests/gpu/test_fast_stage_gpu.py alone) | pytest:<test>[,<test>...] (those GPU tests alone,
# e.g. pytest:tests/gpu/test_loss_gpu.py, with HF_APEX_REQUIRE_KERNELS=1; a test id cannot hold a comma) |
# sdpa (benchmarks/scripts/sdpa_backends.py) | rowkernel (benchmarks/scripts/row_kernel.py; RK_VARIANTS: its
# --variants) | hostprof:<model>:<stage>[:plain] (host_profile.py on that bench row; HP_FLAGS: more
# recipes/finetune.py flags) |
# fp8probe:<model>[:<flag>,<flag>...] (benchmarks/scripts/fp8_probe.py: BF16, FP8 and FP32-master variants of a Llama's
# compiled step in a plain loop, into $OUT/fp8_probe.jsonl; e.g. fp8probe:llama8bwide:--layers,8,--batch,2,--seq,2048;
# torchao's wheel must be in .deps/whl: bash ../shared/tools/gpu-wheels .deps/whl torchao==0.18.0) |
# variant:<model>:<name>:<stage>:<steps>[:<flag>,<flag>...] (benchmarks/scripts/run_variant.py: the bench's run of
# that model and stage with the flags added, to $OUT/variants.jsonl; a flag's value cannot hold a comma;
# e.g. variant:bert:bert-ro:fastest:100:--torch_compile_mode,reduce-overhead; a flag +NAME=VALUE sets an environment
# variable for that run instead, e.g. +WRAPPER=benchmarks/scripts/with_config.py,+TORCH_CONFIG=torch._functorch.config.activation_memory_budget=0.5) |
# resume:<folder>[:<stage,stage>] (the runs/ of an earlier bench into .bench/runs, not overwriting: an unpacked
# bench.tgz's .bench, or a committed folder exported from git history into .deps; with stages, only those stages'
# runs, so that the others run again) |
# bench:<model>[,<model>...][:<stage,stage>] (make bench with --skip_existing, into BENCH_DIR (default .bench), with
# BENCH_EXTRA's flags added, e.g. BENCH_EXTRA="--cold_warm --no_plain_loop"; a model may be a set, e.g. bench:families;
# `bench:` alone: every model, e.g. the whole table once every row is kept, else it runs what is missing until the
# deadline) |
# pbench:<models>/<models>[/...][:<stage,stage>] (on a machine of several GPUs, one make bench per GPU at once, GPU i
# running group i, models joined by ',', e.g. pbench:bert/gpt2,llama; each in .bench-gpu<i>, seeded from .bench/runs
# and with its own autotune cache; then every run goes into .bench/runs, not overwriting, and a `bench:` step after it
# writes the one table; the benches share the host's cores, which host-bound rows (BERT's eager ones) may feel).
# DEADLINE: seconds for the whole call (the call's limit_s less ~30 s: it shrinks as device time runs out); each step
# gets what is left, and .bench (with any .bench-gpu<i>) is packed into $OUT/bench.tgz on the way out, the variants'
# outputs and logs into $OUT/variants.tgz. HF_APEX_COMMIT (the commit of the tree sent, as `git rev-parse --short=7
# HEAD` gives it here) is recorded in the bench's results.json, for `python recipes/bench_report.py append`.
# Needs in .deps/: apex/ (a git archive of the apex commit), data/ (a copy of ../shared/data), whl/ (the wheels of
# ../shared/tools/gpu-wheels: datasets and its two dependencies). TG_ARGS: more pytest flags for testgpu and
# testgpuslow. SITE: where the wheels and apex are installed (default build/site, which stays on a warm machine).
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
DEADLINE=${DEADLINE:-570}
left() { echo $((DEADLINE - SECONDS)); }
SITE=${SITE:-$PWD/build/site}
[ -d $SITE/datasets ] || python3 -m pip install -q --no-index --no-deps --no-compile --target $SITE .deps/whl/*.whl
export PYTHONPATH=$SITE
pack() {
  [ -z "$SMI_PID" ] || kill $SMI_PID 2> /dev/null
  [ -f $OUT/smi.csv ] && mkdir -p .bench && mv $OUT/smi.csv .bench/smi.csv  # (in bench.tgz: files come back up to a count)
  tar czf $OUT/bench.tgz --exclude='*.safetensors' --exclude='*.bin' --exclude='*.pt' --exclude=caches .bench* 2>/dev/null
  # the variants' outputs and logs in one file: a call's output comes back only up to a count of files
  if ls $OUT/variant-*.out > /dev/null 2>&1; then
    (cd $OUT && tar czf variants.tgz variant-*.out variant_logs 2>/dev/null && rm -rf variant-*.out variant_logs)
  fi
}
trap pack EXIT
for step in "$@"; do
  echo "=== $step at ${SECONDS}s ($(date -u +%H:%M:%S))"
  [ "$(left)" -gt 20 ] || { echo "no time left for $step"; break; }
  case $step in
    setup)
      make install OFFLINE=1 2>&1 | tail -2
      if ls .deps/apex-prebuilt/*.part-* > /dev/null 2>&1; then  # a build of an earlier session (step apexpack)
        cat .deps/apex-prebuilt/*.part-* | tar xzf - -C $SITE && echo "apex: the prebuilt copy in .deps/apex-prebuilt"
      fi
      if ! python3 -c "import sys; from hf_apex.kernels.apex.availability import is_fused_adam_available as a, is_fused_norm_available as n; sys.exit(0 if a() and n() else 1)"; then
        # only the extensions hf_apex loads (all twelve took 153-179 s to compile here); all of them if that fails
        timeout -k 10 $(left) make apex OFFLINE=1 APEX_SRC=.deps/apex APEX_EXTENSIONS=hf_apex > $OUT/apex.log 2>&1 \
          || timeout -k 10 $(left) make apex OFFLINE=1 APEX_SRC=.deps/apex >> $OUT/apex.log 2>&1; echo "apex rc $?"
        tail -4 $OUT/apex.log
      fi
      nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader;;
    smi)  # the GPU sampled every 200 ms until the call ends, into $OUT/smi.csv: clocks, power, temperature, why clocks drop
      [ -z "$SMI_PID" ] || kill $SMI_PID 2> /dev/null  # (a second smi step starts over)
      q=clocks_event_reasons.active
      nvidia-smi --query-gpu=$q --format=csv > /dev/null 2>&1 || q=clocks_throttle_reasons.active
      # (nvidia-smi's timestamps are the machine's local time: date's offset is the first line)
      { date +"# local time offset %z"; exec nvidia-smi --format=csv -lms 200 \
        --query-gpu=timestamp,index,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu,$q; } > $OUT/smi.csv 2>&1 &
      SMI_PID=$!; echo "sampling the GPU into smi.csv";;
    apexpack)  # the installed apex (package, dist-info, build record, the extensions hf_apex loads) for .deps/apex-prebuilt
      site=$(cd / && python3 -c "import apex, pathlib; print(pathlib.Path(apex.__file__).parents[1])")
      files=$(cd $site && ls -d apex apex-*.dist-info amp_C*.so fused_layer_norm_cuda*.so apex_C*.so 2> /dev/null)
      (cd $site && tar czf - $files) | split -b 15m - $OUT/apex-prebuilt.tgz.part-
      ls -la $OUT/apex-prebuilt.tgz.part-*;;
    testgpu)
      HF_APEX_REQUIRE_KERNELS=1 HF_APEX_DATA_DIR=$PWD/.deps/data timeout -k 10 $(left) make test-gpu OFFLINE=1 \
        PYTEST_ARGS="-p no:cacheprovider -rfEs --durations=20 --timeout 150 $TG_ARGS" > $OUT/test-gpu.log 2>&1
      echo "test-gpu rc $?"; grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" $OUT/test-gpu.log | tail -25;;
    testgpuslow)
      HF_APEX_REQUIRE_KERNELS=1 HF_APEX_DATA_DIR=$PWD/.deps/data timeout -k 10 $(left) make test-gpu-slow OFFLINE=1 \
        PYTEST_ARGS="-p no:cacheprovider -rfEs --durations=20 $TG_ARGS" > $OUT/test-gpu-slow.log 2>&1
      echo "test-gpu-slow rc $?"; grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" $OUT/test-gpu-slow.log | tail -25;;
    fast)
      HF_APEX_REQUIRE_KERNELS=1 HF_APEX_DATA_DIR=$PWD/.deps/data timeout -k 10 $(left) python3 -m pytest -p no:cacheprovider \
        -rfEs tests/gpu/test_fast_stage_gpu.py > $OUT/test-fast.log 2>&1
      echo "fast rc $?"; tail -5 $OUT/test-fast.log;;
    pytest:*)
      tests=${step#pytest:}
      log=$OUT/pytest-$(echo -n "$tests" | tr -c 'A-Za-z0-9_.-' _ | cut -c1-80).log
      HF_APEX_REQUIRE_KERNELS=1 HF_APEX_DATA_DIR=$PWD/.deps/data timeout -k 10 $(left) python3 -m pytest -p no:cacheprovider \
        -rfEs ${tests//,/ } > $log 2>&1
      echo "pytest rc $?"; tail -3 $log;;
    sdpa)
      timeout -k 10 $(left) python3 benchmarks/scripts/sdpa_backends.py $OUT/sdpa.json --kernels > $OUT/sdpa.log 2>&1
      echo "sdpa rc $?"; grep -v "^  " $OUT/sdpa.log | tail -30;;
    rowkernel)  # benchmarks/scripts/row_kernel.py (RK_VARIANTS: its --variants)
      timeout -k 10 $(left) python3 benchmarks/scripts/row_kernel.py --out $OUT/row_kernel.json \
        ${RK_VARIANTS:+--variants "$RK_VARIANTS"} > $OUT/row_kernel.log 2>&1
      echo "rowkernel rc $?"; cut -c1-220 $OUT/row_kernel.log | tail -30;;
    fp8probe:*)  # fp8probe:<model>[:<flag>,<flag>...]: benchmarks/scripts/fp8_probe.py (torchao's wheel in .deps/whl)
      IFS=: read -r _ model flags <<< "$step"
      [ -d $SITE/torchao ] || python3 -m pip install -q --no-index --no-deps --no-compile --target $SITE .deps/whl/torchao-*.whl
      timeout -k 10 $(left) python3 benchmarks/scripts/fp8_probe.py --model $model --out $OUT/fp8_probe.jsonl \
        ${flags//,/ } > $OUT/fp8probe-$model.log 2>&1
      echo "fp8probe $model rc $?"; cut -c1-400 $OUT/fp8probe-$model.log | tail -6;;
    variant:*)  # variant:<model>:<name>:<stage>:<steps>[:<flag>,<flag>...]: run_variant.py (the Trainer only)
      IFS=: read -r _ model name stage steps flags <<< "$step"
      envs=(); args=()
      for f in ${flags//,/ }; do [[ $f == +*=* ]] && envs+=("${f#+}") || args+=("$f"); done
      env "${envs[@]}" MODEL=$model timeout -k 10 $(left) python3 benchmarks/scripts/run_variant.py $name 1 $stage $steps \
        "${args[@]}" > $OUT/variant-$name.out 2>&1
      echo "variant $name rc $?"; tail -1 $OUT/variant-$name.out | cut -c1-400;;
    hostprof:*)  # hostprof:<model>:<stage>[:plain]: benchmarks/scripts/host_profile.py on the bench's run of that row
      IFS=: read -r _ model stage plain <<< "$step"
      mapfile -d '' -t flags < <(python3 -c "import sys, pathlib; sys.path.insert(0, 'recipes'); import bench
o = bench.parse_args(['--data_dir', '.deps/data', '--warmup', '10']); o.tiny = False
print('\0'.join(bench.finetune_args('$model', '$stage', o, pathlib.Path('.bench/hostprof'))), end='')")
      log=$OUT/hostprof-$model-$stage${plain:+-plain}.log
      timeout -k 10 $(left) python3 benchmarks/scripts/host_profile.py ${plain:+--plain} --steps 20:23 "${flags[@]}" $HP_FLAGS > $log 2>&1
      echo "hostprof $model $stage ${plain} rc $?"; grep -E "wall|Synchronize|_local_scalar" $log | head -8
      sed -n '/== device time by kind/,/^$/p' $log;;
    resume:*)
      IFS=: read -r _ folder stages <<< "$step"
      mkdir -p .bench/runs
      for run in "$folder"/runs/*; do  # <model>-<stage>[-rN][-plain.json]
        stage=$(basename "$run" | sed -E 's/^[a-z0-9]+-//; s/(-r[0-9]+)?(-plain\.json)?$//')
        [ -z "$stages" ] || [[ ",$stages," == *",$stage,"* ]] && cp -r --update=none "$run" .bench/runs/
      done
      echo "$(ls .bench/runs | wc -l) entries in .bench/runs";;
    bench:*)
      IFS=: read -r _ model stages <<< "$step"
      log=$OUT/bench-$(echo -n "${model:-all}" | tr , _).log
      timeout -k 10 $(left) make bench OFFLINE=1 BENCH_DIR=${BENCH_DIR:-.bench} BENCH_MODELS="${model//,/ }" \
        ${stages:+BENCH_STAGES="${stages//,/ }"} BENCH_ARGS="--data_dir .deps/data --skip_existing $BENCH_EXTRA" \
        >> $log 2>&1
      echo "bench ${model:-all} rc $?"; grep -E "bench:|p50|failed|Error|skipped|Not run|step 10 after" $log | tail -40;;
    pbench:*)
      IFS=: read -r _ spec stages <<< "$step"
      IFS=/ read -ra groups <<< "$spec"
      pids=()
      for i in "${!groups[@]}"; do
        mkdir -p .bench-gpu$i/runs
        for model in ${groups[$i]//,/ }; do cp -rn .bench/runs/$model-* .bench-gpu$i/runs/ 2>/dev/null; done
        CUDA_VISIBLE_DEVICES=$i HF_APEX_CACHE=$PWD/.bench-gpu$i/autotune.json timeout -k 10 $(left) make bench OFFLINE=1 \
          BENCH_DIR=.bench-gpu$i BENCH_MODELS="${groups[$i]//,/ }" ${stages:+BENCH_STAGES="${stages//,/ }"} \
          BENCH_ARGS="--data_dir .deps/data --skip_existing" \
          >> $OUT/pbench-gpu$i.log 2>&1 &
        pids+=($!)
      done
      for i in "${!pids[@]}"; do wait "${pids[$i]}"; echo "pbench GPU $i (${groups[$i]}) rc $?"; done
      mkdir -p .bench/runs
      for i in "${!groups[@]}"; do cp -rn .bench-gpu$i/runs/. .bench/runs/; done
      grep -hE "bench:|p50|failed|Error" $OUT/pbench-gpu*.log | tail -40;;
  esac
done
echo "=== done at ${SECONDS}s"
