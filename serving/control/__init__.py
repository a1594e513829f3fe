"""The control path: from a stack config to running Serve applications, and their life after.

:mod:`~serving.control.serve_config` builds the one Serve config a stack config means (deployed
locally and written into the RayService alike); :mod:`~serving.control.stack` runs the local
stack (Ray head, deploy, wait); :mod:`~serving.control.controller` (run by the Serve application
in :mod:`~serving.control.controller_app`) verifies, deploys beside, canaries and finishes or
rolls back a new version, keeping its state in the store (:mod:`~serving.record`);
:mod:`~serving.control.k8s` renders the Kubernetes overlays; :mod:`~serving.control.reference`
writes the config reference; :mod:`~serving.control.cli` is the ``serving`` command.
"""
