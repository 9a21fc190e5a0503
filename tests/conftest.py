import os
import sys

# tests import the shared references as plain modules
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
