"""The fleet renderers: one plan per board kind, rolled out by Ansible or Kubernetes.

Built on the local deployer (:mod:`slmguard.deploy`), never under it: the
local deployer does not import this package (an import-linter contract).
``kinds`` (the board kinds of a fleet and the names orchestrators key on),
``ansible`` (``render --target ansible``: the role, the playbooks, the
inventory and group vars), ``k8s`` (``render --target k8s``: the workload manifests), ``kubelet``
(the node's settings), ``image`` (the server image's facts), ``startup`` (the
start and stop budgets an orchestrator waits for) and ``yamltext`` (the one
YAML writer, untrusted text never syntax).
"""
