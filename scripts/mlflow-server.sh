#!/usr/bin/env bash
# Start an MLflow tracking server for the pipeline's runs (in the foreground; Ctrl-C stops it).
#
#   scripts/mlflow-server.sh                       # http://127.0.0.1:5000, store sqlite:///$PWD/results/mlflow.db
#   scripts/mlflow-server.sh --port 5001 --workers 2
#   XMC_MLFLOW_BACKEND_STORE_URI=postgresql://user:pw@dbhost/mlflow \
#   XMC_MLFLOW_HOST=0.0.0.0 scripts/mlflow-server.sh --allowed-hosts 'login01,login01:5000'
#
# Then, in the shell that runs snakemake (every job inherits it, SLURM jobs included):
#   export MLFLOW_TRACKING_URI=http://127.0.0.1:5000
#
# Settings (environment; any further `mlflow server` option can be given as an argument,
# and a repeated option overrides the default):
#   XMC_MLFLOW_HOST                 interface to bind (default 127.0.0.1: this machine only)
#   XMC_MLFLOW_PORT                 port (default 5000)
#   XMC_MLFLOW_BACKEND_STORE_URI    any SQLAlchemy URL (default: the local runs' SQLite file
#                                   sqlite:///$PWD/results/mlflow.db, so earlier runs show up)
#   XMC_MLFLOW_ARTIFACTS            artifact destination (default $PWD/results/mlartifacts: each
#                                   target's results JSON, plots and leaderboard row)
#   XMC_PYTHON                      the Python with mlflow (default .venv/bin/python of this checkout)
set -euo pipefail

HERE=$(cd "$(dirname "$0")/.." && pwd)
PY=${XMC_PYTHON:-$HERE/.venv/bin/python}
[ -x "$PY" ] || PY=$(command -v python3)
HOST=${XMC_MLFLOW_HOST:-127.0.0.1}
PORT=${XMC_MLFLOW_PORT:-5000}
STORE=${XMC_MLFLOW_BACKEND_STORE_URI:-sqlite:///$PWD/results/mlflow.db}
ARTIFACTS=${XMC_MLFLOW_ARTIFACTS:-$PWD/results/mlartifacts}

case "$STORE" in
    sqlite:///*) mkdir -p "$(dirname "${STORE#sqlite:///}")" ;;
esac
case "$ARTIFACTS" in
    *://*) ;;
    *) mkdir -p "$ARTIFACTS" ;;
esac

echo "mlflow-server: http://$HOST:$PORT  (store $STORE)" >&2
echo "mlflow-server: in the shell that runs snakemake:  export MLFLOW_TRACKING_URI=http://$HOST:$PORT" >&2
exec "$PY" -m mlflow server \
    --host "$HOST" --port "$PORT" \
    --backend-store-uri "$STORE" \
    --artifacts-destination "$ARTIFACTS" \
    "$@"
