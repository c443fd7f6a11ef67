"""horizon-ray: RAM-centric fine-tuning of large language models, served on Ray.

The engine (``horizon_ray.engine``) keeps every parameter, gradient and optimizer state in host RAM and
streams layers through the GPU; the rest of the package turns it into jobs, plans and a service.
"""

__version__ = "0.1.0"
