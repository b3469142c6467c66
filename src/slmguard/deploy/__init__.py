"""The deployment family: the hardened units, sysctl and boot files from a plan, and writing them.

``render`` is text from the plan and what the target holds (read through
``slmguard.host``); ``apply`` writes it under the target root, records what it
changed and rolls it back. It is the only code that writes outside the state
directory, and it knows nothing of the server, the watcher or the audit.

``deploy.fleet`` renders the same plans for many boards (Ansible, Kubernetes)
on top of this local deployer, which never imports it.
"""
