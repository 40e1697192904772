from bsrun.cli import main

main()
