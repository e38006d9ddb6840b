from moeaudit.cli import main

main()
