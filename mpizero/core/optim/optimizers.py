"""Every optimizer by the name the command line uses: adding one is its own file and one line here.

Each entry is an ``Optimizer`` class, which carries what every user of the
list needs: the engine and the single-rank reference its ``rule``,
``verify`` its ``documented`` algorithm and ``verify_settings``, the torch
bridge its ``torch_classes``, checkpoints its class name.
"""

from mpizero.core.optim.adam import Adam, AdamW
from mpizero.core.optim.lion import Lion
from mpizero.core.optim.muon import Muon
from mpizero.core.optim.sgd import SGD

OPTIMIZERS = {"sgd": SGD, "adam": Adam, "adamw": AdamW, "lion": Lion, "muon": Muon}
