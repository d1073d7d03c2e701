"""The job in TensorFlow: MultiWorkerMirroredStrategy, 2 processes, a custom training loop.

TensorFlow has no launcher: start one process per worker, each with its TF_CONFIG (the cluster's
addresses and its own index), e.g. for worker 0 of 2::

    TF_CONFIG='{"cluster": {"worker": ["127.0.0.1:P0", "127.0.0.1:P1"]},
                "task": {"type": "worker", "index": 0}}' \
        python frameworks/tf_multiworker.py --inputs I --out O --variant V

Keras' ``model.fit`` is avoided on purpose: under this strategy Keras 3 fails (keras-team/keras
#20585) and tf_keras logs the loss multiplied by the number of workers. The loop below makes every
step explicit: each replica's loss is its share of the *global* mean (sum / global batch), the
replica context all-reduces the gradients with "sum", and plain SGD updates the variables.
"""
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import job  # noqa: E402


def main():
    args = job.parse_args()
    strategy = tf.distribute.MultiWorkerMirroredStrategy()     # reads TF_CONFIG, joins the cluster
    rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    world = strategy.num_replicas_in_sync                       # 2 workers × 1 CPU replica each
    assert world == job.WORKERS, f"the job is defined for {job.WORKERS} replicas, got {world}"

    inputs = job.load_inputs(args.inputs)
    with strategy.scope():      # variables mirrored on every replica; kernels are [in, out]
        params = [tf.Variable(inputs["w1"].T), tf.Variable(inputs["b1"]),
                  tf.Variable(inputs["w2"].T), tf.Variable(inputs["b2"])]

    def replica_step(x, y):
        w1, b1, w2, b2 = params
        with tf.GradientTape() as tape:
            logits = tf.nn.relu(x @ w1 + b1) @ w2 + b2
            per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
            loss = tf.reduce_sum(per_example) / job.GLOBAL_BATCH   # this replica's share of the mean
        grads = tape.gradient(loss, params)
        grads = tf.distribute.get_replica_context().all_reduce("sum", grads)   # = global mean's grad
        for p, g in zip(params, grads):
            p.assign_sub(args.lr * g)
        return loss

    @tf.function
    def train_step(x, y):
        per_replica = strategy.run(replica_step, args=(x, y))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)  # global mean

    losses, t0 = [], time.perf_counter()
    for t in range(args.steps):
        x, y = job.shard(inputs, t, rank)        # each worker feeds its own contiguous half
        losses.append(float(train_step(tf.constant(x), tf.constant(y))))
    step_s = (time.perf_counter() - t0) / args.steps

    if rank == 0:
        w1, b1, w2, b2 = (p.numpy() for p in params)
        job.save_result(args.out, losses, {"w1": w1.T, "b1": b1, "w2": w2.T, "b2": b2}, step_s=step_s)
    else:
        # collectives pull from the peer's buffers: leaving before worker 0 has finished its last
        # step would reset its connection. Its result file says it has.
        deadline = time.monotonic() + 120
        while not os.path.exists(args.out) and time.monotonic() < deadline:
            time.sleep(0.1)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)   # don't wait for the other worker's gRPC server to shut down
