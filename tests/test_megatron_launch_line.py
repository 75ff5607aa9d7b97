"""A GPT launch line written for Megatron-LM's pretrain_gpt.py runs under torchrun on two
CPU ranks: its model, training, parallel, data, checkpoint, TensorBoard and profiling
flags, the GPU fusion switches (accepted without effect) and the renamed ones, on a
corpus that `mp-data preprocess` built, as Megatron's preprocess_data.py would have.
(TensorBoard's tags themselves: tests/test_train_tensorboard.py.)"""

import json
import os
import signal
import subprocess
import sys

import pytest

from mp_data.cli import main as mp_data

pytestmark = pytest.mark.multirank

MEGATRON_LINE = """
    --use-mcore-models --transformer-impl local
    --num-layers 4 --hidden-size 64 --ffn-hidden-size 176 --num-attention-heads 4
    --group-query-attention --num-query-groups 2 --kv-channels 16
    --seq-length 64 --max-position-embeddings 64
    --position-embedding-type rope --rotary-base 10000 --rotary-percent 1.0
    --swiglu --normalization RMSNorm --norm-epsilon 1e-5 --disable-bias-linear
    --untie-embeddings-and-output-weights --init-method-std 0.02
    --attention-dropout 0.0 --hidden-dropout 0.0 --use-flash-attn
    --no-masked-softmax-fusion --no-gradient-accumulation-fusion --no-bias-swiglu-fusion
    --no-rope-fusion --attention-softmax-in-fp32 --no-persist-layer-norm
    --cross-entropy-loss-fusion --use-cpu-initialization
    --micro-batch-size 2 --global-batch-size 8 --train-iters 6
    --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 1 --lr-decay-iters 6
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0
    --calculate-per-token-loss --manual-gc
    --tensor-model-parallel-size 1 --pipeline-model-parallel-size 2
    --decoder-first-pipeline-num-layers 1
    --use-distributed-optimizer --overlap-grad-reduce --ddp-bucket-size 100000
    --distributed-backend gloo --distributed-timeout-minutes 5
    --tokenizer-type NullTokenizer --vocab-size 1000 --split 90,5,5 --num-workers 0
    --log-interval 2 --eval-interval 3 --eval-iters 1 --save-interval 6
    --ckpt-format torch_dist --log-throughput --log-params-norm
    --tensorboard-log-interval 1 --log-timers-to-tensorboard --log-validation-ppl-to-tensorboard
    --profile --use-pytorch-profiler --profile-step-start 2 --profile-step-end 3
    --logging-level 20
"""


def test_a_megatron_launch_line_trains_on_two_cpu_ranks(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    lines = [" ".join(str((7 * i + j) % 999) for j in range(40 + i % 50)) for i in range(400)]
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    prefix = tmp_path / "corpus"
    assert mp_data(["preprocess", "--input", str(corpus), "--output-prefix", str(prefix),
                    "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000",
                    "--append-eod", "--partitions", "2"]) == 0  # fmt: skip
    argv = [*MEGATRON_LINE.split(), "--data-path", f"{prefix}_text_document",
            "--save", str(tmp_path / "ckpt"), "--load", str(tmp_path / "ckpt"),
            "--tensorboard-dir", str(tmp_path / "tb"),
            "--metrics-file", str(tmp_path / "metrics.jsonl")]  # fmt: skip
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node=2", "--log-dir", str(tmp_path / "torchrun-logs"),
               "-m", "mp_gpt.pretrain", *argv]  # fmt: skip
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "MP_RUN_DIR": str(tmp_path)}
    process = subprocess.Popen(command, env=environment, start_new_session=True, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        output, _ = process.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise
    assert process.returncode == 0, output[-3000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == list(range(1, 7))
    assert records[-1]["lm loss"] < records[0]["lm loss"]
    assert "Megatron-LM flags accepted without effect: --use-mcore-models" in output
    assert output.count("accepted without effect") == 1  # rank 0 only
    assert "[rank 0] INFO mp_train" in output  # --logging-level 20 shows rank 0's info lines
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    events = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    traces = sorted(p.name.split(".")[0] for p in (tmp_path / "tb").glob("*.pt.trace.json"))
    assert events and traces == ["rank0", "rank1"]  # every rank profiles by default
