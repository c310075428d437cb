from torchfarm.cli import main

main()
