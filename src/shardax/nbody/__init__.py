"""Distributed, differentiable particle-mesh N-body simulations (``sx.nbody``).

Gaussian initial conditions that do not depend on the device layout (:func:`white_noise`, :func:`linear_field`),
Lagrangian perturbation theory to second order (:func:`lpt`), particle-mesh forces on slab and pencil meshes
(:func:`pm_forces`, on ``sx.fields`` and ``sx.fft``) and FastPM kick-drift-kick steps in the scale factor
(:func:`evolve`, :func:`simulate`), with the cosmology and growth from jax-cosmo (:class:`Cosmology`,
:func:`linear_power`, :func:`growth_factor`, :func:`growth`). Everything is differentiable in the white noise and
the cosmological parameters. See docs/nbody.md.
"""

from ._api import density as density
from ._api import linear_field as linear_field
from ._api import lpt as lpt
from ._api import pm_forces as pm_forces
from ._api import white_noise as white_noise
from ._cosmology import Cosmology as Cosmology
from ._cosmology import Growth as Growth
from ._cosmology import growth as growth
from ._cosmology import growth_factor as growth_factor
from ._cosmology import hubble_rate as hubble_rate
from ._cosmology import linear_power as linear_power
from ._kdk import StepFactors as StepFactors
from ._kdk import step_factors as step_factors
from ._simulate import Simulation as Simulation
from ._simulate import evolve as evolve
from ._simulate import simulate as simulate

__all__ = [
    "Cosmology", "Growth", "Simulation", "StepFactors", "density", "evolve", "growth", "growth_factor", "hubble_rate",
    "linear_field", "linear_power", "lpt", "pm_forces", "simulate", "step_factors", "white_noise",
]
