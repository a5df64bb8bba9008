import sys

from peft_ext_cli import main

sys.exit(main())
