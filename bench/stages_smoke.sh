#!/usr/bin/env bash
# The four stages on a GPU through `python -m stages.runner` (micro model, params/test.yaml): that they place
# models and batches on cuda and finish. The GPU machine lacks datasets, dill, multiprocess and pydantic: carry
# their wheels in .whl/gpu (and pyarrow in .whl/pyarrow if its own is too old). Output under $OUT.
# EXTRA='--set k=v ...' adds overrides, e.g. the planner or a role's offload.
set -e; export PYTHONPATH=$PWD
python -m pip install -q --no-deps --root-user-action=ignore .whl/gpu/*.whl 2>&1 | grep -v WARNING || true
python -c "import datasets" 2>/dev/null || python -m pip install -q --no-deps --root-user-action=ignore .whl/pyarrow/*.whl
python -c "import torch, transformers, datasets, pyarrow; print(torch.__version__, transformers.__version__, datasets.__version__, pyarrow.__version__, torch.cuda.get_device_name())"
S="--set pipeline.artifacts_dir=$OUT/art --set engine.device=cuda --set ppo.iterations=4 ${EXTRA:-}"  # EXTRA: more --set
for st in sft reward ppo evaluate; do
  t0=$(date +%s.%N)
  python -m stages.runner params/test.yaml $st $S > $OUT/$st.out 2> $OUT/$st.err || { echo "FAILED $st"; grep -v "it/s\|step/s" $OUT/$st.err | tail -25; exit 1; }
  echo "$st $(python -c "print(round($(date +%s.%N)-$t0,1))") s: $(tail -1 $OUT/$st.out | cut -c1-600)"
done
