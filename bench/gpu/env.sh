# On the GPU machine, at the repository root: `source bench/gpu/env.sh` installs the wheels that
# bench/gpu/wheels.sh put in .whl/ (carried there) into /tmp/site, and puts it and this checkout
# first on PYTHONPATH. The image's torch (CUDA build) stays; python3 is the one that holds it.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || return 1
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c "import torch, deepspeed, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'deepspeed', deepspeed.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name(0))" || return 1
