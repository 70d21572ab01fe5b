"""Render the deployment files of one run: Docker Compose, a Kubeflow PyTorchJob (or a dev-workspace Pod), a
Kubeflow Trainer v2 TrainJob with its ClusterTrainingRuntime, a Slurm sbatch script or a SkyPilot task; optionally
apply them; build the images and push one image to every region's registry.

The run is the same everywhere: the container or node runs `trainbox train RECIPE key=value ...` (under
`torchrun` when there is more than one GPU or node; multi-node is torchrun's c10d rendezvous, started by
torchrun itself or by `trainbox train --nnodes`). Restarts are safe because runs resume from their latest
checkpoint (run.resume=auto), and SIGTERM / SIGUSR1 make every rank save before exiting.

Layout: `spec.py` holds the options and the command lines, one module per target renders files from
the YAML/shell templates in `templates/`, `apply.py` runs docker / kubectl / sbatch / sky, `image.py` builds and
pushes, `registry.py` reads registry names and the region -> registry file.
"""
from trainbox.launch.compose import render_compose
from trainbox.launch.k8s import render_k8s
from trainbox.launch.sky import render_sky
from trainbox.launch.slurm import render_slurm
from trainbox.launch.spec import LaunchSpec, Rendered, write_rendered
from trainbox.launch.trainer import render_trainer

__all__ = ["LaunchSpec", "Rendered", "render", "write_rendered"]

RENDERERS = {"compose": render_compose, "k8s": render_k8s, "slurm": render_slurm, "sky": render_sky}


def render(spec: LaunchSpec) -> Rendered:
    """Validate the run's config and render the files of `spec.target`."""
    cfg = spec.check()
    if spec.target == "k8s" and spec.api == "trainer" and not spec.workspace:
        return render_trainer(spec, cfg)
    return RENDERERS[spec.target](spec, cfg)
