"""Pipeline parallelism: cut a model into stages and run a schedule of micro-batches across ranks."""
