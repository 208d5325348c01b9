"""Names of the coordination keys in the job's TCPStore (hosted by the node-0 agent).

Generation-scoped names make a late write from a dead trainer harmless: nobody reads it.
"""

HEARTBEAT = "hb/{rank}"  # json {t, it, phase, pid, gen}: progress of the active trainer
EXCEPTION = "exc/{pid}"  # text of an exception a trainer reported before dying
SHADOW_READY = "ready/{sgen}/{rank}"  # a shadow of set sgen reached its pre-init level
PROMOTE = "promote/{sgen}"  # json {generation}: the agent promotes shadow set sgen
RESUMED = "resumed/{gen}/{rank}"  # json {init_s, resume_s, iteration}: trainer resumed
FAULT_FIRED = "fault/{id}"  # an injected fault already fired (never fire twice)
PG_PREFIX = "pg/{name}/"  # process-group namespace: "g0" for the first actives, "s<sgen>" for shadows
STORE_READY = "stores/{job}/{rank}"  # the retained store of a rank exists and is encoded
FIRST_DONE = "first/{gen}/{rank}"  # time the first iteration of a generation completed on a rank
NODE_DONE = "done/{node}"  # a node's trainers all finished: node 0 keeps the store up until every node's is set
SHADOWS_READY = "shadows/ready"  # the shadow set that is ready to be promoted now ("" if none)
FAILURE = "failure/{gen}"  # json {rank, hof, reason, node}: the job-wide verdict on generation gen's failure
NODE_STEP = "node/{gen}/{step}/{node}"  # a node reached a lockstep point of a recovery (value: its data)
SHADOW_REPLACE = "sreplace/{gen}"  # counter: shadow sets replaced in generation gen (all nodes follow)
FINISHED = "finished/{gen}/{rank}"  # a trainer completed training; an abnormal exit after it is not a failure
JOB_ID = "jobid/{gen}"  # per-rank agents: the retained-memory job id from generation gen on (first writer wins)
# -- hot spares (runtime/membership.py, runtime/transfer.py) --
AGENT_BEAT = "agent/{launch}"  # counter: the agent of launch node rank ``launch`` is alive (it changes)
SLOT_HOLDER = "slot/{node}"  # json NodeAssignment: the spare that holds node slot ``node`` now (unset: its own agent)
REPLACE = "replace/{gen}/{node}"  # the spare (launch node rank) chosen for node slot ``node`` in generation gen
SPARE_ASSIGN = "assign/{launch}"  # json NodeAssignment: spare ``launch`` takes over a node slot
TRANSFER = "xfer/{gen}/{node}/"  # namespace of one state transfer to the spare of node slot ``node``
TRANSFER_MANIFEST = "xfer/{gen}/{node}/manifest"  # json TransferManifest: what the source sends, with digests
TRANSFER_DONE = "xfer/{gen}/{node}/done"  # the receiving spare verified every segment (or says why not)
RETIRED = "retired/{launch}"  # the agent of launch node rank ``launch`` took its node out of the job (not a HOF)
JOB_OVER = "job/over"  # node 0: every node finished; spares still waiting exit
