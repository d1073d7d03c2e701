"""The job in TensorFlow: MirroredStrategy, one process, two replicas on two logical CPUs.

    python frameworks/tf_mirrored.py --inputs I --out O --variant V

One process drives both replicas (as one process drives all the GPUs of a machine); the
strategy hands each replica its own half of the batch and all-reduces between the devices.
"""
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import job  # noqa: E402


def main():
    args = job.parse_args()
    cpu = tf.config.list_physical_devices("CPU")[0]     # split it in 2, before any op runs
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * job.WORKERS)
    devices = [d.name for d in tf.config.list_logical_devices("CPU")]
    strategy = tf.distribute.MirroredStrategy(devices)
    assert strategy.num_replicas_in_sync == job.WORKERS

    inputs = job.load_inputs(args.inputs)
    with strategy.scope():      # one copy of each variable per device; kernels are [in, out]
        params = [tf.Variable(inputs["w1"].T), tf.Variable(inputs["b1"]),
                  tf.Variable(inputs["w2"].T), tf.Variable(inputs["b2"])]

    def replica_step(x, y):
        w1, b1, w2, b2 = params
        with tf.GradientTape() as tape:
            logits = tf.nn.relu(x @ w1 + b1) @ w2 + b2
            per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
            loss = tf.reduce_sum(per_example) / job.GLOBAL_BATCH   # this replica's share of the mean
        grads = tape.gradient(loss, params)
        grads = tf.distribute.get_replica_context().all_reduce("sum", grads)
        for p, g in zip(params, grads):
            p.assign_sub(args.lr * g)
        return loss

    @tf.function
    def train_step(x, y):
        per_replica = strategy.run(replica_step, args=(x, y))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    losses, t0 = [], time.perf_counter()
    for t in range(args.steps):
        # replica r gets worker r's contiguous half, placed on its device
        x, y = (strategy.experimental_distribute_values_from_function(
            lambda ctx, i=i: tf.constant(job.shard(inputs, t, ctx.replica_id_in_sync_group)[i]))  # noqa: B023 - called in this iteration
            for i in (0, 1))
        losses.append(float(train_step(x, y)))
    step_s = (time.perf_counter() - t0) / args.steps

    w1, b1, w2, b2 = (p.numpy() for p in params)
    job.save_result(args.out, losses, {"w1": w1.T, "b1": b1, "w2": w2.T, "b2": b2}, step_s=step_s)


if __name__ == "__main__":
    main()
