# Source from the repo root on the GPU machine (device tool, carry .gpubundle): sets up once per warm
# machine (the bundle of ../shared/gpu/make_bundle.sh, redis, the 1B model), then only re-exports. Sets GPU_ARGS.
export PYTHONUNBUFFERED=1
if [ -f /tmp/gpu_env.sh ]; then . /tmp/gpu_env.sh; else
  t0=$(date +%s)
  . .gpubundle/on_gpu.sh > /tmp/setup.log 2>&1
  export PATH=$PWD/.gpubundle/redis:$PATH LD_LIBRARY_PATH=$PWD/.gpubundle/redis:$LD_LIBRARY_PATH
  echo /tmp/site > $(python3 -c "import site;print(site.getsitepackages()[0])")/zz_tmp_site.pth
  export -p > /tmp/gpu_env.sh
  echo "[gpu] setup $(( $(date +%s) - t0 )) s"
fi
if [ ! -f models/1b-llama/config.json ]; then
  t0=$(date +%s); python3 -m engine.build_model --preset 1b --out models/1b-llama > /tmp/build.log 2>&1; echo "[gpu] build 1b $(( $(date +%s) - t0 )) s"
fi
GPU_ARGS="--device cuda --dtype bfloat16 --preset 1b --max-seq-len 4096 --text-env $TEXT_ENV --tag h200 --out-dir $OUT"
