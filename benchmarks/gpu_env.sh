# Sourced by the GPU scripts (never run): the repository on PYTHONPATH, unbuffered output, and
# the wheels carried in .whl/ (pyzmq, fastapi, xgrammar, py-spy, ...) installed into /tmp/site,
# which goes first on PYTHONPATH and PATH. Uses $PY when set (default python3).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  ${PY:-python3} -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
fi
