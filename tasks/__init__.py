"""The ``inv`` command line: one module per namespace, each a list of thin tasks over ``harness``.

Every task loads the inventory, calls the harness (which returns data and never prints), and shows
the result: a rich table or line for people, ``--json`` for machines, one ``error:`` line per failed
host and a non-zero exit. Module level imports here stay light (invoke only), so ``inv -l`` is fast.
"""
from invoke import Collection

from tasks import audit, deploy, env, hosts, patch, pipeline, pull, runs, serve, service, setup, stage

ns = Collection()
ns.add_task(audit.audit)
ns.add_task(setup.setup)
ns.add_task(pipeline.pipeline)
ns.add_task(pull.pull)
ns.add_task(deploy.deploy)
ns.add_collection(Collection.from_module(hosts))
ns.add_collection(Collection.from_module(patch))
ns.add_collection(Collection.from_module(env))
ns.add_collection(stage.collection())
ns.add_collection(Collection.from_module(runs))
ns.add_collection(Collection.from_module(service))
ns.add_collection(Collection.from_module(serve))
