import os
import sys

# The evaluation's scripts (evaluation/) and the detector corpus's modules (evaluation/detectors/,
# which import one another by their bare names), as the scripts put them on the path themselves
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, os.pardir, "detectors"))
sys.path.insert(0, os.path.join(HERE, os.pardir))
