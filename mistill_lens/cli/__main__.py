from mistill_lens.cli import main

main()
