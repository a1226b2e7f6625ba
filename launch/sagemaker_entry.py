"""SageMaker framework-container entry point (entry_point="launch/sagemaker_entry.py"): zerorun reads the
training contract itself (zerorun/platforms.py); the `--key value` hyperparameters in argv are overrides."""
import sys

from zerorun.cli import main

sys.exit(main())
